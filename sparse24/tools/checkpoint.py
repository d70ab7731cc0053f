"""What the checkpoint commands (``prune``, ``inspect``) share: what a model folder is, which stored tensors
count as weight matrices, the report row of one left dense, and a first read of
safetensors shards that names a bad file in one line."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..format import FLOAT_DTYPES, Sparse24Tensor
from .cli_common import _one_line

__all__ = ["is_model_folder", "is_weight_matrix", "dense_row", "check_shards", "stored_mask", "quant_label",
           "LAYER_ENTRIES"]

# The state-dict entries of a 2:4 layer besides its bias (masked: weight + mask; compressed: values + meta,
# INT8/INT4 scale, INT4 zero points and group size).
LAYER_ENTRIES = ("weight", "mask", "values", "meta", "scale", "zero", "group_size")


def is_model_folder(path: str | os.PathLike) -> bool:
    """A folder with a ``config.json`` (a Hugging Face model folder)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def is_weight_matrix(key: str, t: torch.Tensor) -> bool:
    """The tensors a ``prune`` report counts, for a file and a folder alike: every 2-D
    floating-point ``weight`` (``<prefix>.weight``) stored in the checkpoint."""
    return (key == "weight" or key.endswith(".weight")) and t.dim() == 2 and t.dtype in FLOAT_DTYPES


def quant_label(quant: dict) -> str:
    """A report's words for :func:`sparse24.nn.quant_options`: ``""``, ``" int8"``, ``" int4 g128"``
    (``" int4 g128 asym"`` with zero points)."""
    if quant.get("quantize") != "int4":
        return f" {quant['quantize']}" if quant else ""
    return f" int4 g{quant['group_size']}" + ("" if quant["symmetric"] else " asym")


def dense_row(key: str, t: torch.Tensor, reason: str) -> dict:
    """The report row of a 2-D weight left dense."""
    nbytes = t.numel() * t.element_size()
    return {"name": key, "shape": tuple(t.shape), "dtype": str(t.dtype)[6:], "action": "kept dense",
            "reason": reason, "kept": 1.0, "bytes_before": nbytes, "bytes_after": nbytes}


def check_shards(folder: Path, shards: list[str]) -> None:
    """Read every shard's header before any work, so that a truncated or foreign file
    is named in one line (safetensors checks that the header covers the whole file)."""
    from safetensors import SafetensorError, safe_open

    for shard in shards:
        try:
            with safe_open(folder / shard, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read {folder / shard} as a safetensors file (truncated, or not one): "
                             f"{_one_line(e)}") from None


def stored_mask(p: Sparse24Tensor) -> torch.Tensor:
    """``(R, C)`` bool: the positions a compressed weight keeps (its 2-bit slots), whatever the values."""
    R, C = p.shape
    keep = torch.zeros(R, C // 4, 4, dtype=torch.bool, device=p.device)
    return keep.scatter_(-1, p.slots(), True).view(R, C)

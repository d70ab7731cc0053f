"""The tile-config space of the 2:4 Triton kernels: what a config is, which
ones the tuner may try for a shape, and the untuned default.

A :class:`KernelConfig` names the kernel variant (``kernel``) and its launch
parameters. M is bucketed (:data:`M_BUCKETS`, powers of two) so one tuned
entry serves every batch size of its bucket.
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["KernelConfig", "KERNEL_VARIANTS", "M_BUCKETS", "DTYPE_KEYS", "m_bucket", "dtype_key", "builtin_config",
           "candidate_configs"]

# Kernel variants a config may name (kernels/): "matmul" expands each weight
# tile in registers and runs tl.dot (any M).
KERNEL_VARIANTS = ("matmul",)
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
DTYPE_KEYS = tuple(_DTYPE_NAMES.values()) + tuple(f"int8-{n}" for n in _DTYPE_NAMES.values())


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of a 2:4 kernel variant (names as in the kernel)."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    kernel: str = "matmul"

    _JSON = {"KERNEL": "kernel", "BLOCK_M": "block_m", "BLOCK_N": "block_n", "BLOCK_K": "block_k",
             "GROUP_M": "group_m", "SPLIT_K": "split_k", "num_warps": "num_warps", "num_stages": "num_stages"}

    def validate(self) -> "KernelConfig":
        """Raise ValueError unless the kernel can compile this config on any GPU."""
        def pow2(v, lo, hi):
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi and v & (v - 1) == 0
        checks = [  # every tl.dot dim >= 16; BLOCK_K covers whole metadata words (32 columns)
            ("KERNEL", self.kernel, self.kernel in KERNEL_VARIANTS, f"one of {KERNEL_VARIANTS}"),
            ("BLOCK_M", self.block_m, pow2(self.block_m, 16, 256), "a power of two in [16, 256]"),
            ("BLOCK_N", self.block_n, pow2(self.block_n, 16, 256), "a power of two in [16, 256]"),
            ("BLOCK_K", self.block_k, pow2(self.block_k, 32, 512), "a power of two in [32, 512]"),
            ("GROUP_M", self.group_m, isinstance(self.group_m, int) and 1 <= self.group_m <= 64, "in [1, 64]"),
            ("SPLIT_K", self.split_k, isinstance(self.split_k, int) and 1 <= self.split_k <= 32, "in [1, 32]"),
            ("num_warps", self.num_warps, pow2(self.num_warps, 1, 16), "1, 2, 4, 8 or 16"),
            ("num_stages", self.num_stages, isinstance(self.num_stages, int) and 1 <= self.num_stages <= 8,
             "in [1, 8]"),
        ]
        for name, value, ok, need in checks:
            if not ok:
                raise ValueError(f"bad kernel config {name}={value!r}: must be {need}")
        return self

    def to_json(self) -> dict:
        """The config as a file stores it: ``{"BLOCK_M": ..., "num_stages": ...}``."""
        return {k: getattr(self, f) for k, f in self._JSON.items()}

    @classmethod
    def from_json(cls, d) -> "KernelConfig":
        if not isinstance(d, dict) or set(d) != set(cls._JSON):
            got = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"a config must have exactly the keys {sorted(cls._JSON)}, got {got}")
        return cls(**{f: d[k] for k, f in cls._JSON.items()}).validate()


def m_bucket(M: int) -> int:
    """The smallest bucket >= M (powers of two, capped at 4096; 1 for M <= 1)."""
    # bit arithmetic, not a scan: this runs on every kernel call
    return 1 if M <= 1 else min(1 << (M - 1).bit_length(), M_BUCKETS[-1])


def dtype_key(x_dtype: torch.dtype, int8_weights: bool = False) -> str:
    """``float16`` etc. for the activation dtype, prefixed ``int8-`` for INT8 weights."""
    name = _DTYPE_NAMES.get(x_dtype)
    if name is None:
        raise TypeError(f"no kernel configs for activations of dtype {x_dtype}")
    return f"int8-{name}" if int8_weights else name


def builtin_config(M: int, N: int = 4096, K: int = 4096, num_sms: int = 132) -> KernelConfig:
    """The untuned fallback: small tiles that compile on every CUDA GPU Triton
    supports (<= 48 KB of shared memory). At decode sizes (M <= 16) the
    programs must fill the ``num_sms`` multiprocessors (N = 4096 with
    BLOCK_N = 64 gives 64 programs for an H200's 132): BLOCK_N shrinks to 16
    first, and only then split-K grows (each split keeping >= 2 K-tiles),
    since split-K costs a zeroed fp32 buffer and a copy per call. Not measured:
    a tuned file should replace it."""
    if M <= 16:
        bn = next((b for b in (64, 32, 16) if -(-N // b) >= num_sms), 16)
        programs, split = -(-N // bn), 1
        while programs * split < num_sms and split < 8 and K >= 2 * 128 * (2 * split):
            split *= 2
        return KernelConfig(16, bn, 128, 8, split, 4 if bn >= 64 else 2, 3)
    if M <= 64:
        return KernelConfig(32, 64, 64, 8, 1, 4, 3)
    return KernelConfig(64, 64, 64, 8, 1, 4, 3)


def candidate_configs(M: int, N: int, K: int, num_sms: int = 132) -> list[KernelConfig]:
    """The config space searched for one (M, N, K): small per regime, because
    every config is a separate compile (seconds each).

    Decode-sized M (<= 16) streams the weight once: one 16-row block, tiles
    from 16 x 256 to 128 x 64 along (N, K), and split-K while the programs
    stay within 4 per SM and each split keeps >= 2 K-tiles (more loads in
    flight when N alone gives few programs). Larger M is compute-bound:
    bigger square-ish tiles, more warps.
    """
    out: list[KernelConfig] = []
    if M <= 16:
        for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 64), (64, 128), (128, 64)):
            warps = 2 if bn * bk <= 4096 else 4
            programs = -(-N // bn)
            splits = [1] + [s for s in (2, 4, 8) if programs * s <= 4 * num_sms and K >= 2 * s * bk]
            out += [KernelConfig(16, bn, bk, 8, s, warps, stages) for s in splits for stages in (3, 5)]
    elif M <= 128:
        bms = (32,) if M <= 32 else (32, 64)
        for bm in bms:
            for bn, bk in ((64, 64), (64, 128), (128, 64), (128, 32)):
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    out.append(KernelConfig(bm, bn, bk, 8, 1, warps, stages))
    else:
        for bm, bn, bk in ((64, 64, 64), (64, 128, 32), (64, 128, 64), (128, 64, 64), (128, 128, 32),
                           (128, 128, 64), (128, 256, 32)):
            # 4 warps only up to 64 x 128 tiles: 128 x 256 x 32 with 4 warps
            # spills 1 KB and 128 x 128 x 64 needs 254 registers (sm_90 cubin,
            # scripts/kernel_static_check.py, Triton 3.9)
            for warps, stages in ((4, 3), (8, 3), (8, 4)) if bm * bn <= 64 * 128 else ((8, 3), (8, 4)):
                out.append(KernelConfig(bm, bn, bk, 8, 1, warps, stages))
    return [c.validate() for c in out]

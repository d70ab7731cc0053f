"""Triton JIT kernels (installed as ``sparse24.kernels``). Triton only: no torch.nn, no policy."""
